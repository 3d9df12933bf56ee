"""Fabric benchmark: does the emulated fabric pace links and collide flows as specified,
and up to what aggregate rate does this machine keep up?

    .venv/bin/python benchmarks/bench_fabric.py [--reps 5] [--mbit 200] [--mb 10]
                                                [--envelope 100,200,400,800]

1. Collisions: on the `small` fabric, two flows from different hosts to different
   hosts, once forced onto one spine (source ports the kernel oracle maps to the same
   spine) and once split over the two spines. Each flow's rate against the link rate
   (target: about 1/2 together, about 1 split, within 10%), median (min-max) of --reps.
2. Fidelity envelope: on `rack4`, k flows on disjoint paths at once (k = 1, 2, 4, 8),
   links at each --envelope rate; per run the flows' mean rate against the configured
   rate (pacing) and the machine's CPU idle. Where pacing stays within 10% with idle
   left over, the machine kept up; the largest such aggregate is the envelope.
Needs root (network namespaces) and nftables.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time


import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

from kvpath.fabric import FabricSpec  # noqa: E402
from kvpath.oracle import KernelOracle  # noqa: E402
from kvpath.testbed.flowcheck import Flow, run_flows  # noqa: E402
from kvpath.testbed.netns_fabric import LinkShaping, NetnsFabric  # noqa: E402

med = statistics.median


def fmt(vals: list[float], f: str = "{:.2f}") -> str:
    return f"{f.format(med(vals))} ({f.format(min(vals))}-{f.format(max(vals))})"


def ports_by_spine(oracle: KernelOracle, src: str, dst: str, dport: int, start: int) -> dict[str, list[int]]:
    keys = [(src, dst, p, dport, "tcp") for p in range(start, start + 64)]
    out: dict[str, list[int]] = {}
    for k, path in zip(keys, oracle.paths(keys)):
        out.setdefault(path.spine, []).append(k[2])
    return out


def bench_collisions(console: Console, mbit: float, nbytes: int, reps: int) -> dict:
    spec = FabricSpec.resolve("small")
    b = spec.spine_link_gbps * 1000 / mbit
    res: dict[str, list[float]] = {"same": [], "split": [], "same_own": [], "split_own": []}
    with NetnsFabric(spec, LinkShaping.scaled(spec, b)) as fabric:
        oracle = KernelOracle(spec, fabric.ns)
        a = ports_by_spine(oracle, "l0h0", "l1h0", 5000, 42000)
        c = ports_by_spine(oracle, "l0h1", "l1h1", 5001, 43000)
        for i in track(range(reps), description="collisions", console=console):
            same = [Flow("l0h0", "l1h0", a["spine0"][i], 5000), Flow("l0h1", "l1h1", c["spine0"][i], 5001)]
            split = [Flow("l0h0", "l1h0", a["spine0"][i + reps], 5000), Flow("l0h1", "l1h1", c["spine1"][i], 5001)]
            for kind, flows in (("same", same), ("split", split)):
                rs = run_flows(fabric, flows, nbytes)
                assert all(r.measured_spine == r.predicted_spine for r in rs)
                # each flow's share while both run: the pair's bytes over the pair's span, halved
                # (a flow's own bytes/FCT also counts the time it runs alone after the other ends)
                span = max(r.end_s for r in rs) - min(r.start_s for r in rs)
                res[kind].append(sum(r.bytes for r in rs) * 8 / span / 1e6 / 2 / mbit)
                res[kind + "_own"] += [r.mbit_s / mbit for r in rs]
    t = Table(title=f"1. two {nbytes / 1e6:.0f} MB flows, links {mbit:.0f} Mbit/s: rate / link rate, median (min-max) "
                    f"of {reps} runs x 2 flows")
    t.add_column("placement")
    t.add_column("each flow's rate while both run\n/ link rate")
    t.add_column("target")
    t.add_column("each flow's bytes / its own FCT\n/ link rate")
    t.add_row("both on spine0", fmt(res["same"]), "0.45-0.55", fmt(res["same_own"]))
    t.add_row("split over spine0 and spine1", fmt(res["split"]), "0.90-1.10", fmt(res["split_own"]))
    console.print(t)
    return {k: med(v) for k, v in res.items()}


def bench_envelope(console: Console, rates: list[float], nbytes: int) -> list[dict]:
    spec = FabricSpec.resolve("rack4")
    rows = []
    # disjoint paths: host i of leaf 0 -> host i of leaf 1 etc., each pinned to its own spine
    pairs = [(f"l{l}h{h}", f"l{(l + 1) % 4}h{h}") for h in range(4) for l in (0, 2)]
    for mbit in track(rates, description="envelope", console=console):
        with NetnsFabric(spec, LinkShaping.scaled(spec, spec.spine_link_gbps * 1000 / mbit)) as fabric:
            oracle = KernelOracle(spec, fabric.ns)
            for k in (1, 2, 4, 8):
                flows = []
                used: set[tuple[int, str]] = set()
                for j, (src, dst) in enumerate(pairs[:k]):
                    leaf = spec.locate(src)[0]
                    by = ports_by_spine(oracle, src, dst, 6000 + j, 44000 + 100 * j)
                    spine = next(s for s in sorted(by) if (leaf, s) not in used)
                    used.add((leaf, spine))
                    flows.append(Flow(src, dst, by[spine][0], 6000 + j))
                psutil.cpu_times_percent(None)
                t0 = time.monotonic()
                rs = run_flows(fabric, flows, nbytes * max(1, int(mbit // 100)))
                idle = psutil.cpu_times_percent(None).idle
                rate = [r.mbit_s / mbit for r in rs]
                rows.append({"mbit": mbit, "k": k, "aggregate": k * mbit, "pacing": rate, "idle": idle,
                             "wall": time.monotonic() - t0})
    t = Table(title="2. fidelity envelope on rack4: k flows on disjoint paths at once")
    for c in ("link Mbit/s", "flows", "aggregate Mbit/s", "rate / link rate (min-max)", "CPU idle %", "kept up"):
        t.add_column(c)
    for r in rows:
        ok = min(r["pacing"]) >= 0.9 and max(r["pacing"]) <= 1.1 and r["idle"] > 10
        r["ok"] = ok
        t.add_row(f"{r['mbit']:.0f}", str(r["k"]), f"{r['aggregate']:.0f}",
                  f"{min(r['pacing']):.2f}-{max(r['pacing']):.2f}", f"{r['idle']:.0f}", "yes" if ok else "[red]no[/red]")
    console.print(t)
    best = max((r["aggregate"] for r in rows if r["ok"]), default=0)
    console.print(f"  largest aggregate that kept pacing within 10% with CPU idle left: [bold]{best:.0f} Mbit/s[/bold]")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mbit", type=float, default=200.0, help="link rate of section 1")
    ap.add_argument("--mb", type=float, default=10.0, help="MB per flow (x link/100 Mbit in section 2)")
    ap.add_argument("--envelope", default="100,200,400,800", help="link rates (Mbit/s) of section 2")
    ap.add_argument("--sections", default="1,2")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    nbytes = int(args.mb * 1e6)
    sections = {int(s) for s in args.sections.split(",") if s}
    if 1 in sections:
        bench_collisions(console, args.mbit, nbytes, args.reps)
    if 2 in sections:
        bench_envelope(console, [float(x) for x in args.envelope.split(",") if x], nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
