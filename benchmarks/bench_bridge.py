"""Bridge benchmark: how fast the flow-level model sets up and runs.

    .venv/bin/python benchmarks/bench_bridge.py [--flows 2000] [--reps 3]

1. Set-up on fabrics of 1,024, 8,192 and 62,500 hosts (the largest the addressing allows) (the spec, the link numbering and
   capacities, and the link ids of --flows flows): median (min-max) of --reps.
2. A run of --flows flows with random endpoints and spines, Poisson arrivals at a load
   where flows share links, on each fabric: wall time and mean FCT over standalone FCT.
3. The serving simulation at the published study's shape (rack4, 100 Gbit/s, 8P8D, 500
   requests, Zipf 1024-4096, 6 QPS): wall time per mode.
The ns-3 backend does not exist yet, so the flow-vs-ns3 ratio is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvpath.fabric import FabricSpec  # noqa: E402
from kvpath.iteration_time import IterationTimeModel  # noqa: E402
from kvpath.workloads import load_workload  # noqa: E402
from simulator_bridge.flow_model import FlowModel, FlowSpec, LinkIndex, trivial_fct  # noqa: E402
from simulator_bridge.serving_sim import ServingConfig, simulate  # noqa: E402

# leaves, spines, hosts per leaf; the spec's addressing (10.<leaf>.<host>.x) caps a fabric at 250 x 250 hosts
FABRICS = {"1K": (8, 8, 128), "8K": (64, 32, 128), "62.5K": (250, 63, 250)}


def random_flows(spec: FabricSpec, n: int, rng: np.random.Generator, load: float = 0.5) -> list[FlowSpec]:
    hosts = spec.leaves * spec.hosts_per_leaf
    size = 10_000_000
    # arrivals so that on average `load` of the hosts' links are busy
    rate = load * hosts / (size / (spec.host_link_gbps * 1e9 / 8))
    t = np.cumsum(rng.exponential(1 / rate, n))
    out = []
    for i in range(n):
        a, b = rng.choice(hosts, 2, replace=False)
        sa, sb = divmod(int(a), spec.hosts_per_leaf), divmod(int(b), spec.hosts_per_leaf)
        out.append(FlowSpec(spec.host_name(*sa), spec.host_name(*sb), size, float(t[i]), int(rng.integers(spec.spines))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flows", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    t = Table(title=f"flow model: set-up and a run of {args.flows} flows (median (min-max) of {args.reps})")
    for c in ("fabric", "hosts", "links", "set-up s", "run s", "mean FCT / alone"):
        t.add_column(c)
    rng = np.random.default_rng(0)
    for name, (leaves, spines, hpl) in FABRICS.items():
        spec = FabricSpec(leaves=leaves, spines=spines, hosts_per_leaf=hpl)
        flows = random_flows(spec, args.flows, rng)
        setups, runs, ratio = [], [], 0.0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            idx = LinkIndex(spec)
            idx.links(flows)
            setups.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fct = FlowModel(spec).run(flows)
            runs.append(time.perf_counter() - t0)
            ratio = float((fct / trivial_fct(spec, flows)).mean())

        def fmt(v: list[float]) -> str:
            return f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"

        t.add_row(name, str(leaves * hpl), str(LinkIndex(spec).n), fmt(setups), fmt(runs), f"{ratio:.2f}")
    console.print(t)
    spec = FabricSpec.resolve("rack4")
    w = load_workload("zipf", n=500, qps=6.0, seed=0, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    s = Table(title="serving simulation, rack4 8P8D, 500 requests at 6 QPS: wall time per mode (s)")
    for c in ("backend", "ecmp", "cc", "dc"):
        s.add_column(c)
    for backend in ("trivial", "flow"):
        walls = []
        for mode in ("ecmp", "cc", "dc"):
            _, info = simulate(spec, list(w.requests), ServingConfig(mode=mode, backend=backend),
                               IterationTimeModel.preset())
            walls.append(f"{info['wall_s']:.2f}")
        s.add_row(backend, *walls)
    console.print(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
