"""Decisions past one process: the reservation service on a 65,536-host fabric.

    .venv/bin/python benchmarks/bench_scale.py [--requests 3000] [--qps 1200] [--delays 0.001 0.01]
                                               [--repeats 3]

Two questions, on a leaf-spine fabric of 16 leaves x 4,096 hosts (65,536 hosts) and 8
spines, 120 P and 120 D engines (8 lanes per pair: 14,400 worker pairs, 115,200 lanes):

1. **How fast one `cc` service decides** at that size: reserve+release pairs per CPU
   second in one process (the registry and the link loads are what grow with the
   fabric; a decision costs the same per candidate lane whatever the host count).
2. **What deciding elsewhere costs in quality**: the serving simulation (flow backend,
   `kvpath bridge simulate`) with ecmp, `cc` (one service, a view that is always
   current) and `dc` (an agent at each P host deciding from a view of the other hosts'
   reservations that arrives ``delay`` late, as a pub/sub system would carry it) at each
   ``--delays`` value: push FCT mean and p99, TTFT mean and p99.

The service's own bounds (16,384 worker pairs, 262,144 lanes) are what a single
process holds; past them a cluster runs one service per shard of pairs (docs/reservation.md,
"Past one process")."""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpath.fabric import FabricSpec, pd_placement
from kvpath.reservation.decisions import LaneInfo, ReservationService

FABRIC = {"leaves": 16, "spines": 8, "hosts_per_leaf": 4096, "host_link_gbps": 100, "spine_link_gbps": 100}
POOLS = (120, 120)
LANES = 8


def decisions_per_cpu_s(n: int, seed: int = 0) -> tuple[float, int]:
    """(reserve+release pairs per CPU second, lanes registered) for ``n`` pairs on the
    65,536-host fabric, about 256 flows kept live."""
    spec = FabricSpec(**FABRIC)
    p_hosts, d_hosts = pd_placement(spec, *POOLS)
    svc = ReservationService(spec, "cc")
    lanes = [LaneInfo(i, 40000 + 17 * i, 0) for i in range(LANES)]
    for p in p_hosts:
        for d in d_hosts:
            svc.register_lanes(p, d, lanes)
    rng = random.Random(seed)
    work = [(rng.choice(p_hosts), rng.choice(d_hosts), rng.randint(10**6, 10**9)) for _ in range(n)]
    live: list[str] = []
    t = time.process_time()
    for k, (s, d, b) in enumerate(work):
        live.append(svc.reserve(s, d, b, transfer_id=f"t{k}").lease_id)
        if len(live) > 256:
            svc.release(live.pop(0))
    return n / (time.process_time() - t), len(p_hosts) * len(d_hosts) * LANES


def simulate(fabric: Path, modes: str, delay: float, args: argparse.Namespace, seed: int) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "kvpath.cli", "bridge", "simulate", "--fabric", str(fabric),
         "--pools", f"{POOLS[0]}P{POOLS[1]}D", "--requests", str(args.requests), "--qps", str(args.qps),
         "--mode", modes, "--dc-delay-s", str(delay), "--backend", "flow", "--lanes", str(LANES),
         "--seed", str(seed), "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--qps", type=float, default=1200.0)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.001, 0.01],
                    help="dc: how late each P host's agent hears the others' reservations (s)")
    ap.add_argument("--repeats", type=int, default=3, help="workload seeds (0, 1, ...)")
    ap.add_argument("--decisions", type=int, default=50000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    con = Console(width=150)
    rate, n_lanes = decisions_per_cpu_s(args.decisions)
    con.print(f"one cc service, 65,536 hosts, {n_lanes:,} lanes registered: {rate:,.0f} reserve+release pairs "
              f"per CPU second")
    fabric = Path(tempfile.mkdtemp()) / "fabric.json"
    fabric.write_text(json.dumps(FABRIC))
    rows: dict[str, list[dict]] = {}
    for seed in range(args.repeats):
        for r in simulate(fabric, "ecmp,cc", 0.0, args, seed):
            rows.setdefault(r["mode"], []).append(r)
        for delay in args.delays:
            for r in simulate(fabric, "dc", delay, args, seed):
                rows.setdefault(f"dc, view {delay * 1e3:g} ms late", []).append(r)
    t = Table(title=f"flow backend, 65,536 hosts ({FABRIC['leaves']} leaves x {FABRIC['hosts_per_leaf']} hosts, "
                    f"{FABRIC['spines']} spines, 100 Gbit/s), {POOLS[0]}P{POOLS[1]}D, {args.requests} zipf requests "
                    f"at {args.qps:g}/s; range over {args.repeats} seeds")
    for col in ("decisions", "push FCT mean ms", "push FCT p99 ms", "TTFT mean ms", "TTFT p99 ms", "sim wall s"):
        t.add_column(col)

    def rng(rs: list[dict], k: str, scale: float = 1e3) -> str:
        v = [r[k] * scale for r in rs]
        return f"{min(v):.1f}..{max(v):.1f}"

    for name, rs in rows.items():
        t.add_row(name, rng(rs, "fct_mean_s"), rng(rs, "fct_p99_s"), rng(rs, "ttft_mean_s"), rng(rs, "ttft_p99_s"),
                  rng(rs, "wall_s", 1.0))
    con.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
