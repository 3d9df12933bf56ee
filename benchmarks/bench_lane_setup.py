"""Does a D behind a firewall delay another D's pushes? (root, network namespaces, nftables)

P runs in the root namespace. D "ok" runs in one namespace, D "fw" in another whose
nftables drop every new TCP connection coming in, so P's lane probes to it never
complete (each lane gives up after PROBE_TIMEOUT_S) while its control connection (D
dials out to P) works. D "fw" re-registers every second, so P keeps trying to open its
lanes. D "ok" makes small pushes one at a time; this prints their latency with and
without D "fw", alternating rounds, median and p99 (min-max over rounds).

    .venv/bin/python benchmarks/bench_lane_setup.py [--seconds 12] [--rounds 3]

Latency is measured from the bench (register on D, submit on P, wait on D: three
queue round trips to child processes), the same way in both conditions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from kvpath.connector.config import KVPathConfig
from kvpath.connector.control_auth import shared_keys
from kvpath.testbed.peer_process import BufferSpec, PeerProcess
from kvpath.testbed.veth_peer import veth_peer

SPEC = BufferSpec(regions=2, num_blocks=64, block_len=16 * 1024, block_size=16)
TAG = os.getpid() % 10000
NETS = {"ok": (f"kvlsok{TAG}", "10.213.8"), "fw": (f"kvlsfw{TAG}", "10.213.9")}
PORT = 6990


# the firewall: D "fw" accepts no new connection from its link (P's lanes); its own
# control connection out to P, and its loopback, keep working
FIREWALL = ("table inet kvfw {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n"
            "  ct state established,related accept\n  iifname \"{ns_if}\" tcp flags & (syn | ack) == syn drop\n"
            " }}\n}}\n")


@contextlib.contextmanager
def namespaces():
    with contextlib.ExitStack() as stack:
        for name, (ns, net) in NETS.items():
            rules = FIREWALL.format(ns_if=f"{ns}d") if name == "fw" else None
            stack.enter_context(veth_peer(ns, f"{ns}p", f"{ns}d", f"{net}.1", f"{net}.2", nft_rules=rules))
        yield


def configs(keys: dict) -> tuple[KVPathConfig, dict[str, KVPathConfig]]:
    devs = ",".join(f"{ns}p" for ns, _ in NETS.values())
    p = KVPathConfig(lanes=2, side_channel_host="0.0.0.0", side_channel_port=PORT, ucx_net_devices=devs,
                     registration_timeout_s=2.0, max_wait_s=20.0, **keys)
    d = {name: KVPathConfig(lanes=2, side_channel_host=f"{net}.2", ucx_net_devices=f"{ns}d",
                            registration_timeout_s=2.0, max_wait_s=20.0, **keys)
         for name, (ns, net) in NETS.items()}
    return p, d


def pushes(p: PeerProcess, d: PeerProcess, addr: str, seconds: float, tag: str, gap_s: float = 0.05) -> list[float]:
    """One 32 KiB push every ``gap_s`` for ``seconds``: the latency of each."""
    out = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        time.sleep(gap_s)
        rid = f"{tag}-{i}"
        d.call("register", rid, rid, addr, [i % 32], 0)
        t0 = time.perf_counter()
        p.call("submit", rid, rid, [32 + i % 32])
        _, done, failed = d.call("wait", [rid], 30)
        # a push that did not complete counts as its wait (30 s): the stall is the result
        out.append(time.perf_counter() - t0 if done == [rid] and not failed else float("inf"))
    return out


def keep_knocking(d_fw: PeerProcess, addr: str, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        d_fw.call("register", f"fw-{i}", f"fw-{i}", addr, [1], 0)
        i += 1
        stop.wait(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="pushes per round: one every 50 ms this long")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, nftables)")
        return 2
    console = Console()
    keys = shared_keys(f"/tmp/kvpath-bench-lanes-{TAG}")
    p_cfg, d_cfg = configs(keys)
    res: dict[str, list[list[float]]] = {"alone": [], "with a firewalled D": []}
    stats = {}
    with namespaces(), PeerProcess(p_cfg, SPEC, role="prefill") as p, \
            PeerProcess(d_cfg["ok"], SPEC, netns=NETS["ok"][0]) as d_ok:
        addr_ok, addr_fw = f"{NETS['ok'][1]}.1:{PORT}", f"{NETS['fw'][1]}.1:{PORT}"
        pushes(p, d_ok, addr_ok, 0.3, "warm")
        for r in track(range(args.rounds), description="rounds", console=console):
            for cond in (("alone", "with a firewalled D") if r % 2 == 0 else ("with a firewalled D", "alone")):
                if cond == "alone":
                    res[cond].append(pushes(p, d_ok, addr_ok, args.seconds, f"a{r}"))
                    continue
                with PeerProcess(d_cfg["fw"], SPEC, netns=NETS["fw"][0]) as d_fw:
                    stop = threading.Event()
                    knocker = threading.Thread(target=keep_knocking, args=(d_fw, addr_fw, stop), daemon=True)
                    knocker.start()
                    time.sleep(1.0)  # P is inside a set-up that cannot finish
                    res[cond].append(pushes(p, d_ok, addr_ok, args.seconds, f"f{r}"))
                    stop.set()
                    knocker.join(5)
                    stats = d_fw.call("stats")[1]
        p_stats = p.call("stats")[1]
    t = Table(title=f"D 'ok': latency of 32 KiB pushes, one every 50 ms for {args.seconds:g} s per round, "
                    f"{args.rounds} rounds (per round median, p99, max: median of rounds (min-max)), ms")
    for c in ("condition", "median", "p99", "max", "not done in 30 s", "pushes"):
        t.add_column(c)
    for cond, rounds in res.items():
        meds = [1e3 * float(np.median(x)) for x in rounds]
        p99s = [1e3 * float(np.percentile(x, 99)) for x in rounds]
        maxs = [1e3 * max(x) for x in rounds]
        lost = sum(1 for x in rounds for v in x if v == float("inf"))
        t.add_row(cond, *(f"{np.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in (meds, p99s, maxs)),
                  str(lost), str(sum(len(x) for x in rounds)))
    console.print(t)
    console.print(f"P saw {p_stats.get('handshakes', 0)} Hellos and opened {p_stats.get('lanes_opened', 0)} lanes; "
                  f"D 'fw' (last round): {stats.get('handshakes_refused', 0)} handshakes refused, "
                  f"{stats.get('recv_failed', 0)} requests failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
