"""Shared by the bench_connector.py sections: layout constants, push sizing, formatting, and the
instrumentation of P's sender (TransferRecords, lane agents' completion stamps, registrations).

Imported by bench_connector.py (kvpath installed, see scripts/setup.sh), which sets the UCX and
BLAS environment before numpy is imported.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from typing import Any

from kvpath.connector.messages import parse_notif
from kvpath.connector.sender import PushSender
from kvpath.trace import TransferRecord

MiB = 1 << 20
REGIONS = 4  # KV regions (layers x K/V) in the benchmark layouts
LANES = 4  # lanes (P agents / raw agents) the concurrent pushes spread over
med = statistics.median

# The control channel's knobs every benchmark config gets (set_control): CURVE keys made
# for the run, or loopback plaintext. One dict, written only by set_control.
CONTROL_KNOBS: dict[str, Any] = {}


def set_control(mode: str) -> None:
    """``curve``: one key pair made for this run, trusted by both sides; ``plaintext``: none."""
    from kvpath.connector.control_auth import shared_keys

    CONTROL_KNOBS.clear()
    if mode == "curve":
        CONTROL_KNOBS.update(shared_keys(tempfile.mkdtemp(prefix="kvpath-bench-keys-")))
    elif mode == "plaintext":
        CONTROL_KNOBS["control_plaintext"] = True
    else:
        raise ValueError(f"control mode must be curve or plaintext, got {mode!r}")


def plan_push(mib: float, block_len: int = 16 * 1024) -> tuple[int, int, int]:
    """(block_len, blocks, exact bytes) for a push of ``mib`` MiB over REGIONS regions:
    16 KiB per block and region (less for a push smaller than one block), the total
    within half a block of the request."""
    target = mib * MiB
    if target < REGIONS * block_len:
        block_len = max(64, math.ceil(target / REGIONS / 64) * 64)
    nb = max(1, round(target / (REGIONS * block_len)))
    return block_len, nb, REGIONS * nb * block_len


def fmt_bytes(n: int) -> str:
    if n >= MiB:
        return f"{n // MiB} MiB" if n % MiB == 0 else f"{n / MiB:.2f} MiB"
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n / 1024:.1f} KiB"


def ms(v: float) -> str:
    return f"{v * 1e3:.2f}" if abs(v) < 0.1 else f"{v * 1e3:.1f}"


def med_range(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{ms(med(vals))} ({ms(min(vals))}-{ms(max(vals))})"


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


def _record_sink(sender: PushSender) -> dict:
    """P's TransferRecords by transfer id, as the writer thread writes them."""
    recs: dict = {}
    orig = sender.trace.write

    def keep(r):
        if isinstance(r, TransferRecord):  # the log also gets the lanes' records
            recs[r.transfer_id] = r
        orig(r)

    sender.trace.write = keep
    return recs


def _instrument(agent, stamps: dict) -> None:
    """Patch one of P's lane agents (this instance only; bench side): per transfer id, when
    check_xfer_state first said DONE (time.monotonic()) and how long release_xfer_handle took."""
    tids: dict[int, str | None] = {}
    init, check, release = agent.initialize_xfer, agent.check_xfer_state, agent.release_xfer_handle

    def initialize_xfer(op, local, remote, name, notif_msg=b"", *args, **kw):
        h = init(op, local, remote, name, notif_msg, *args, **kw)
        tids[id(h)] = parse_notif(notif_msg) if notif_msg else None
        return h

    def check_xfer_state(h):
        st = check(h)
        tid = tids.get(id(h))
        if st != "PROC" and tid is not None:
            stamps.setdefault(tid, {}).setdefault("done", time.monotonic())
        return st

    def release_xfer_handle(h):
        t0 = time.monotonic()
        release(h)
        tid = tids.pop(id(h), None)
        if tid is not None:
            stamps.setdefault(tid, {})["release"] = time.monotonic() - t0

    agent.initialize_xfer, agent.check_xfer_state = initialize_xfer, check_xfer_state
    agent.release_xfer_handle = release_xfer_handle


def _wait_registrations(sender: PushSender, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sender.stats.snapshot()["registrations"] < count:
        if time.monotonic() > deadline:
            raise RuntimeError("P did not receive D's registrations")
        time.sleep(0.001)
