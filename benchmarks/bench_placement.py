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
  bytes first.

Per variant and run: TTFT mean and p99, the push's FCT mean and p99, TPOT mean, the push's
share of the mean TTFT; ranges over the runs; each variant against the baseline per
repeat. Then ``kvpath bridge simulate --placement`` (flow backend) on the same trace and
fabric for the policies it models (the uplink cap is not modelled there): its TTFT and FCT
per policy, to compare the ranking.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_placement.py [--repeats 2] [--gbps 50]
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

from testbed_bench import KVPATH, run, setup, span

VARIANTS = "ecmp/least_outstanding,cc/least_outstanding,cc/joint,cc/joint/srpt1"
# the simulation's rows for the variants it models: (--mode, --placement)
SIM = {"ecmp": ("ecmp", "load"), "cc": ("cc", "load"), "cc/joint": ("cc", "joint")}




def _row(s: dict) -> dict:
    dc = s["datacenter"]
    parts = dc.get("ttft_parts_mean_s") or {}
    ttft = dc["ttft_s"]["mean"]
    return {"label": s["label"], "valid": s["fidelity"]["valid"], "repeat": s.get("repeat", 0), "ttft_mean": ttft,
            "ttft_p99": dc["ttft_s"]["p99"], "fct_mean": dc["fct_s"]["mean"], "fct_p99": dc["fct_s"]["p99"],
            "tpot_mean": dc["tpot_s"]["mean"], "push_share": (parts.get("push") or 0.0) / ttft if ttft else None}




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--qps", type=float, default=15.0)
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--scale-b", type=float, default=1000.0)
    ap.add_argument("--scale-s", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--gbps", type=float, default=50.0, help="every link's rate, datacenter Gbit/s")
    ap.add_argument("--out", default="/tmp/kvpath-placement")
    ap.add_argument("--skip-runs", action="store_true", help="reuse the testbed runs already in --out")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    console = Console(width=160)
    out = Path(args.out)
    fabric, trace = setup(out, args.gbps, args.requests, args.seed)
    common = ["--fabric", str(fabric), "--pools", "3P6D", "--workload", str(trace), "--requests", str(args.requests),
              "--qps", str(args.qps)]
    console.rule(f"testbed: {args.repeats} repeats of {args.variants}, rotated")
    if not args.skip_runs:
        run([KVPATH, "testbed", "run", "--engine", "emulated", *common, "--variants", args.variants,
              "--seed", str(args.seed), "--scale-b", str(args.scale_b), "--scale-s", str(args.scale_s),
              "--repeats", str(args.repeats), "--out", str(out / "testbed")], "kvpath testbed run")
    summary = json.loads((out / "testbed" / "summary.json").read_text())
    rows = [_row(s) for s in summary["runs"]]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    sim_rows = {}
    for label in labels:
        if label not in SIM:
            continue
        mode, placement = SIM[label]
        got = run([KVPATH, "bridge", "simulate", "--fabric", str(fabric), "--pools", "3P6D", "--workload", str(trace),
                    "--requests", str(args.requests), "--qps", str(args.qps), "--mode", mode, "--backend", "flow",
                    "--placement", placement, "--json"], "kvpath bridge simulate")
        sim_rows[label] = json.loads(got.strip().splitlines()[-1])[0]
    t = Table(title=f"placement and push order, datacenter ms (ranges over {args.repeats} runs; {args.gbps:g} Gbit/s)")
    for c in ("variant", "valid", "TTFT mean", "TTFT p99", "FCT mean", "FCT p99", "TPOT mean", "push share",
              "sim TTFT mean", "sim FCT p99"):
        t.add_column(c)
    for label in labels:
        rs = [r for r in rows if r["label"] == label]
        sim = sim_rows.get(label)
        t.add_row(label, f"{sum(r['valid'] for r in rs)}/{len(rs)}", span([r["ttft_mean"] for r in rs]),
                  span([r["ttft_p99"] for r in rs]), span([r["fct_mean"] for r in rs]),
                  span([r["fct_p99"] for r in rs]), span([r["tpot_mean"] for r in rs], fmt="{:.2f}"),
                  span([r["push_share"] for r in rs], scale=100, fmt="{:.0f}%"),
                  f"{sim['ttft_mean_s'] * 1e3:.1f}" if sim else "-", f"{sim['fct_p99_s'] * 1e3:.1f}" if sim else "-")
    console.print(t)
    base = labels[0]
    for label in labels[1:]:
        for k in ("ttft_mean", "ttft_p99", "fct_mean", "fct_p99", "tpot_mean"):
            gains = []
            for rep in sorted({r["repeat"] for r in rows}):
                a = next((r for r in rows if r["label"] == base and r["repeat"] == rep), None)
                b = next((r for r in rows if r["label"] == label and r["repeat"] == rep), None)
                if a and b and a[k]:
                    gains.append(100 * (b[k] / a[k] - 1))
            if gains:
                console.print(f"{label} vs {base}, {k}: {min(gains):+.1f}%..{max(gains):+.1f}% over {len(gains)} "
                              f"repeat pairs")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "sim": sim_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
