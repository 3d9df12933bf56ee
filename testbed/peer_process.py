"""A D-side (or P-side) transfer engine in a child process, driven over a queue.

Used by the two-process NIXL tests and by ``benchmarks/bench_connector.py`` so
that pushes really cross a process (and a UCX TCP connection), without vLLM; the
child can live in another network namespace.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpath.connector.config import KVPathConfig


@dataclass
class BufferSpec:
    regions: int = 4
    num_blocks: int = 128
    block_len: int = 4096
    block_size: int = 16


def make_buffers(spec: BufferSpec, fill: str = "zeros", seed: int = 0) -> list[np.ndarray]:
    if fill == "random":
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 256, spec.num_blocks * spec.block_len, dtype=np.uint8) for _ in range(spec.regions)]
    return [np.zeros(spec.num_blocks * spec.block_len, dtype=np.uint8) for _ in range(spec.regions)]


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (before any socket exists),
    as ``ip netns exec`` does: /sys is remounted in a private mount namespace, since
    UCX finds its network devices in /sys/class/net."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what} failed entering netns {name}")

    with open(f"/var/run/netns/{name}") as f:
        check(libc.setns(f.fileno(), 0x40000000), "setns")  # CLONE_NEWNET
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x80000, None), "mount --make-rslave /")  # MS_REC | MS_SLAVE
    check(libc.umount2(b"/sys", 2), "umount /sys")  # MNT_DETACH
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


def serve_decode(cfg: KVPathConfig, spec: BufferSpec, q_in: mp.Queue, q_out: mp.Queue, opts: dict[str, Any]) -> None:
    from kvpath.connector.layout import layout_from_buffers
    from kvpath.connector.receiver import PushReceiver

    logging.basicConfig(level=logging.INFO, format="D %(levelname)s %(name)s: %(message)s")
    if opts.get("netns"):
        enter_netns(opts["netns"])
    bufs = make_buffers(spec)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, spec.num_blocks, spec.block_size)
    rx = PushReceiver(cfg, lay, spans, compat=opts.get("compat")).start()
    canary = opts.get("canary")  # a byte written into every block as soon as it is released
    blocks_of: dict[str, list[int]] = {}
    released_at: dict[str, float] = {}
    seen_at_release: dict[str, int] = {}  # canary-valued bytes found in a block when released
    done: set[str] = set()
    failed: set[str] = set()
    waiter: tuple[set[str], float] | None = None
    q_out.put(("ready", rx.engine_id))
    while True:
        try:
            cmd, *args = q_in.get(timeout=0.002)
        except queue.Empty:
            cmd, args = None, []
        rel, fail = rx.take()
        now = time.monotonic()
        for rid in rel:
            released_at[rid] = now
            if canary is not None:  # "reuse" the blocks at once, like vLLM would
                for b in bufs:
                    view = b.reshape(spec.num_blocks, spec.block_len)[blocks_of.get(rid, [])]
                    seen_at_release[rid] = seen_at_release.get(rid, 0) + int((view == canary).sum())
                    b.reshape(spec.num_blocks, spec.block_len)[blocks_of.get(rid, [])] = canary
        done |= rel
        failed |= fail
        if waiter is not None and (waiter[0] <= done or now > waiter[1]):
            want = waiter[0]
            q_out.put(("result", sorted(done & want), sorted(failed & want)))
            waiter = None
        if cmd is None:
            continue
        if cmd == "register":
            blocks_of[args[0]] = list(args[3])
            rx.register(*args)
            q_out.put(("ok",))
        elif cmd == "cancel":
            rx.cancel(args[0])
            q_out.put(("ok",))
        elif cmd == "reconnect":  # break the control connections (no restart)
            rx.reconnect()
            q_out.put(("ok",))
        elif cmd == "wait":  # until all given request ids were released, or timeout
            waiter = (set(args[0]), time.monotonic() + args[1])
        elif cmd == "read":
            blocks = args[0]
            q_out.put(("data", [b.reshape(spec.num_blocks, spec.block_len)[blocks].tobytes() for b in bufs]))
        elif cmd == "released_at":  # seconds since each release, and canary bytes seen then
            q_out.put(("released_at", {r: time.monotonic() - t for r, t in released_at.items()}, seen_at_release))
        elif cmd == "info":  # for raw-NIXL baselines: D's agent metadata and layout
            q_out.put(("info", rx.agent.get_agent_metadata(), rx.agent.name, lay))
        elif cmd == "stats":
            q_out.put(("stats", rx.stats.snapshot()))
        elif cmd == "stop":
            rx.close()
            q_out.put(("bye",))
            return


def serve_prefill(cfg: KVPathConfig, spec: BufferSpec, q_in: mp.Queue, q_out: mp.Queue, opts: dict[str, Any]) -> None:
    """A P-side writer in a child process (so a test can kill P mid-push)."""
    from kvpath.connector.layout import layout_from_buffers
    from kvpath.connector.sender import PushSender

    logging.basicConfig(level=logging.INFO, format="P %(levelname)s %(name)s: %(message)s")
    if opts.get("netns"):
        enter_netns(opts["netns"])
    rng = np.random.default_rng(opts.get("seed", 0))
    high = opts.get("max_byte", 256)  # the source bytes stay below this value
    bufs = [rng.integers(0, high, spec.num_blocks * spec.block_len, dtype=np.uint8) for _ in range(spec.regions)]
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    rank = opts.get("rank", 0)  # a TP rank: its control port is side_channel_port + rank
    tx = PushSender(cfg, layout_from_buffers(spans, spec.num_blocks, spec.block_size), spans, rank=rank,
                    compat=opts.get("compat")).start()
    q_out.put(("ready", tx.engine_id))
    while True:
        cmd, *args = q_in.get()
        if cmd == "submit":
            tx.submit_finished(*args)
            q_out.put(("ok",))
        elif cmd == "read":
            q_out.put(("data", [b.reshape(spec.num_blocks, spec.block_len)[args[0]].tobytes() for b in bufs]))
        elif cmd == "address":
            q_out.put(("address", tx.address))
        elif cmd == "stats":
            q_out.put(("stats", tx.stats.snapshot()))
        elif cmd == "stop":
            tx.close()
            q_out.put(("bye",))
            return


class PeerProcess:
    """Start with ``with PeerProcess(cfg, spec) as d: d.call("register", ...)``."""

    def __init__(self, cfg: KVPathConfig, spec: BufferSpec, netns: str | None = None, compat: Any = None,
                 canary: int | None = None, role: str = "decode", **opts: Any):
        ctx = mp.get_context("spawn")
        self.q_in: mp.Queue = ctx.Queue()
        self.q_out: mp.Queue = ctx.Queue()
        opts.update({"netns": netns, "compat": compat, "canary": canary})
        target = serve_decode if role == "decode" else serve_prefill
        self.proc = ctx.Process(target=target, args=(cfg, spec, self.q_in, self.q_out, opts), daemon=True)
        self.spec = spec

    def __enter__(self) -> "PeerProcess":
        self.proc.start()
        self.engine_id = self.get(60)[1]
        return self

    def get(self, timeout: float) -> tuple[Any, ...]:
        return self.q_out.get(timeout=timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60) -> tuple[Any, ...]:
        self.q_in.put((cmd, *args))
        return self.get(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def __exit__(self, *exc: Any) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
