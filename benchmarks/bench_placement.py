"""Joint placement and push order on emulated engines at datacenter scale, beside what
the serving simulation predicts for the same policies.

The setup of ``bench_layer_push.py`` (an Azure-2023-format trace, prompts 136-6,000
tokens, a 3x3x3 leaf-spine fabric with ``ecmp_seed`` 7 at ``--gbps``, 3P6D emulated
engines), run as ``kvpath testbed run --variants V1,V2,... --repeats N``: the variants
interleaved and rotated, every repeat on a fresh fabric. The default variants:

- ``ecmp/least_outstanding``: the baseline (least outstanding, the hash's lane);
- ``cc/least_outstanding``: path reservation alone;
- ``cc/joint``: P, D and the lane by predicted TTFT (docs/placement.md);
- ``cc/joint/srpt1``: the same, one whole push at a time per host uplink, the fewest
  bytes first;
- ``MODE+layer/...``: the same with layer-wise pushes.

Per variant and run: TTFT mean and p99, the push's FCT mean and p99, TPOT mean, the push's
share of the mean TTFT, goodput (the share of requests within a TTFT SLO); ranges over
the seeds and runs; each variant against the baseline per (seed, repeat) pair. Each seed
is its own testbed session (its own trace with ``--workload azure``). Then ``kvpath bridge
simulate`` (flow backend) of every variant on the same trace and fabric (its placement,
push granularity and uplink cap): its TTFT and FCT per variant, to compare the ranking.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_placement.py [--repeats 2] [--gbps 50]
        [--seeds 7 8 9] [--workload azure|zipf] [--ttft-slo-ms MS]
        [--variants ...] [--out /tmp/kvpath-placement] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from testbed_bench import KVPATH, run, setup, span, summary_row

from kvpath.bridge.serving_sim import placement_of
from kvpath.testbed.cli import parse_variant
from kvpath.testbed.repeats import run_dir
from kvpath.trace import read_trace

VARIANTS = "ecmp/least_outstanding,cc/least_outstanding,cc/joint,cc/joint/srpt1"




def _row(s: dict, run_dir: Path, seed: int) -> dict:
    dc = s["datacenter"]
    return {**summary_row(s), "label": s["label"], "seed": seed, "ttft_p50": dc["ttft_s"]["p50"],
            "fct_mean": dc["fct_s"]["mean"], "fct_p99": dc["fct_s"]["p99"],
            "ttfts": _ttfts(run_dir, s["time_scale_testbed_per_dc"]), "dir": str(run_dir)}


def _ttfts(run_dir: Path, scale: float) -> list[float | None]:
    """Every request's TTFT in datacenter seconds (None: it failed), from the run's trace."""
    return [None if q.ttft_s is None or q.status != "ok" else q.ttft_s / scale
            for q in read_trace(run_dir / "trace.jsonl").requests]


def _goodput(row: dict, slo_s: float) -> float:
    """The share of the run's requests served with TTFT within the SLO (failed: missed)."""
    t = row["ttfts"]
    return sum(1 for x in t if x is not None and x <= slo_s) / len(t) if t else 0.0


def _simulate(fabric: Path, workload: str, seed: int, args: argparse.Namespace, labels: list[str]) -> dict:
    """``kvpath bridge simulate`` (flow backend) of every variant: its mode, push
    granularity, placement (least outstanding is the service's ``load``) and uplink cap
    (its wait bound, the connector's 0.2 s, on the datacenter clock)."""
    sim_rows = {}
    wait_s = 0.2 / (args.scale_b / args.scale_s)
    for label in labels:
        mode, gran, policy, order, uplink = parse_variant(label, "least_outstanding", "fifo")
        placement = placement_of(policy) or "round_robin"  # (the command's name for none)
        got = run([KVPATH, "bridge", "simulate", "--fabric", str(fabric), "--pools", "3P6D", "--workload", workload,
                   "--requests", str(args.requests), "--qps", str(args.qps), "--seed", str(seed), "--mode", mode,
                   "--backend", "flow", "--placement", placement, "--push-granularity", gran,
                   "--uplink-pushes", str(uplink), "--push-order", order, "--push-queue-max-wait-s", repr(wait_s),
                   "--json"], "kvpath bridge simulate")
        sim_rows[label] = json.loads(got.strip().splitlines()[-1])[0]
    return sim_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every variant per seed")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--qps", type=float, default=15.0)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--scale-b", type=float, default=1000.0)
    ap.add_argument("--scale-s", type=float, default=250.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[7], help="workload and run seeds, one testbed session each")
    ap.add_argument("--workload", choices=("azure", "zipf"), default="azure",
                    help="azure: an Azure-2023-format trace written per seed; zipf: the testbed's own (prompts "
                         "1,024-4,096 tokens)")
    ap.add_argument("--gbps", type=float, default=50.0, help="every link's rate, datacenter Gbit/s")
    ap.add_argument("--ttft-slo-ms", type=float, default=None,
                    help="goodput: the share of requests within this TTFT, datacenter ms (default: twice the "
                         "baseline's median TTFT of the first seed)")
    ap.add_argument("--out", default="/tmp/kvpath-placement")
    ap.add_argument("--skip-runs", action="store_true", help="reuse the testbed runs already in --out")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    console = Console(width=170)
    out = Path(args.out)
    rows: list[dict] = []
    sims: dict[int, dict] = {}
    for seed in args.seeds:
        sd = out / f"seed{seed}"
        fabric, trace = setup(sd, args.gbps, args.requests, seed)
        workload = str(trace) if args.workload == "azure" else "zipf"
        common = ["--fabric", str(fabric), "--pools", "3P6D", "--workload", workload, "--requests",
                  str(args.requests), "--qps", str(args.qps)]
        console.rule(f"seed {seed}: {args.repeats} repeats of {args.variants}, rotated")
        if not args.skip_runs:
            run([KVPATH, "testbed", "run", "--engine", "emulated", *common, "--variants", args.variants,
                 "--seed", str(seed), "--scale-b", str(args.scale_b), "--scale-s", str(args.scale_s),
                 "--repeats", str(args.repeats), "--out", str(sd / "testbed")], "kvpath testbed run")
        summary = json.loads((sd / "testbed" / "summary.json").read_text())
        for s in summary["runs"]:
            rows.append(_row(s, run_dir(sd / "testbed", s["label"], s.get("repeat", 1), args.repeats), seed))
        sims[seed] = _simulate(fabric, workload, seed, args, list(dict.fromkeys(r["label"] for r in rows)))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    base = labels[0]
    slo = (args.ttft_slo_ms / 1e3 if args.ttft_slo_ms is not None
           else 2 * next(r["ttft_p50"] for r in rows if r["label"] == base))
    for r in rows:
        r["goodput"] = _goodput(r, slo)
    t = Table(title=f"placement and push order, {args.workload}, {args.gbps:g} Gbit/s, datacenter ms (ranges over "
                    f"{len(args.seeds)} seeds x {args.repeats} runs); goodput: share of requests with TTFT <= "
                    f"{slo * 1e3:.0f} ms")
    for c in ("variant", "valid", "TTFT mean", "TTFT p99", "FCT mean", "FCT p99", "TPOT mean", "push share",
              "goodput", "sim TTFT mean", "sim FCT p99"):
        t.add_column(c)
    for label in labels:
        rs = [r for r in rows if r["label"] == label]
        sim = [sims[sd][label] for sd in args.seeds if label in sims[sd]]
        t.add_row(label, f"{sum(r['valid'] for r in rs)}/{len(rs)}", span([r["ttft_mean"] for r in rs]),
                  span([r["ttft_p99"] for r in rs]), span([r["fct_mean"] for r in rs]),
                  span([r["fct_p99"] for r in rs]), span([r["tpot_mean"] for r in rs], fmt="{:.2f}"),
                  span([r["push_share"] for r in rs], scale=100, fmt="{:.0f}%"),
                  span([r["goodput"] for r in rs], scale=100, fmt="{:.0f}%"),
                  span([x["ttft_mean_s"] for x in sim]), span([x["fct_p99_s"] for x in sim]))
    console.print(t)
    for label in labels[1:]:
        for k in ("ttft_mean", "ttft_p99", "fct_mean", "fct_p99", "tpot_mean", "goodput"):
            gains = []
            for seed in args.seeds:
                for rep in sorted({r["repeat"] for r in rows}):
                    a = next((r for r in rows if (r["label"], r["seed"], r["repeat"]) == (base, seed, rep)), None)
                    b = next((r for r in rows if (r["label"], r["seed"], r["repeat"]) == (label, seed, rep)), None)
                    if a and b and a[k]:
                        gains.append(100 * (b[k] / a[k] - 1))
            if gains:
                console.print(f"{label} vs {base}, {k}: {min(gains):+.1f}%..{max(gains):+.1f}% over {len(gains)} "
                              f"(seed, repeat) pairs: {' '.join(f'{g:+.1f}' for g in gains)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"slo_s": slo, "rows": [{k: v for k, v in r.items() if k != "ttfts"}
                                                                       for r in rows], "sim": sims}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
