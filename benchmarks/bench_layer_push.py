"""Layer-wise against whole-request push on emulated engines at datacenter scale, and what
the serving simulation predicts for the same configuration.

An Azure-2023-format trace (synthetic, the shape of the issue's: prompts 136-6,000
tokens with a median near 1,050, outputs 2-800 with a median near 50, bursty arrivals)
on a 3x3x3 leaf-spine fabric at 100 Gbit/s (``--gbps``; ``ecmp_seed`` 7), 3P6D emulated engines,
``kvpath testbed run --push-granularity request,layer --repeats N``: the two variants
interleaved and rotated (A B, B A, ...), every repeat on a fresh fabric. Per variant
and run: TTFT mean and p99, TPOT mean, the push's share of the mean TTFT (the part
after P's prefill ends: ``ttft_parts_mean_s``), P's prefill (median); the ranges over
the valid runs; the gain of ``layer`` over ``request`` per repeat pair. Then
``kvpath bridge simulate`` (flow backend, round robin as the testbed's default) on the
same trace, both granularities: the gain the simulation predicts.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_layer_push.py [--repeats 3]
        [--policy least_outstanding] [--gbps 50] [--backends flow,ns3] [--out /tmp/kvpath-layer-push] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from testbed_bench import KVPATH, run, setup, span, summary_row

logger = logging.getLogger(__name__)

VARIANTS = ("request", "layer")




def _row(s: dict) -> dict:
    row = summary_row(s)
    return {**row, "prefill_p50": (s["datacenter"].get("ttft_breakdown_s") or {}).get("P prefill"),
            "push_after_prefill_mean": row["parts"].get("push")}




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--qps", type=float, default=15.0)
    ap.add_argument("--policy", default="round_robin", help="round_robin (the simulation's) or least_outstanding")
    ap.add_argument("--layer-group", type=int, default=4)
    ap.add_argument("--scale-b", type=float, default=1000.0)
    ap.add_argument("--scale-s", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--gbps", type=float, default=100.0, help="every link's rate, datacenter Gbit/s")
    ap.add_argument("--out", default="/tmp/kvpath-layer-push")
    ap.add_argument("--backends", default="flow", help="the calibrated replay's backends (flow, ns3)")
    ap.add_argument("--skip-runs", action="store_true", help="reuse the testbed runs already in --out")
    ap.add_argument("--json", default=None, help="write the rows and the ranges here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    console = Console(width=160)
    out = Path(args.out)
    fabric, trace = setup(out, args.gbps, args.requests, args.seed)
    common = ["--fabric", str(fabric), "--pools", "3P6D", "--workload", str(trace),
              "--requests", str(args.requests), "--qps", str(args.qps), "--mode", "cc",
              "--push-granularity", ",".join(VARIANTS), "--layer-group", str(args.layer_group)]
    console.rule(f"testbed: {args.repeats} repeats of {', '.join(VARIANTS)}, rotated")
    if not args.skip_runs:
        run([KVPATH, "testbed", "run", "--engine", "emulated", *common, "--policy", args.policy, "--seed", str(args.seed),
              "--scale-b", str(args.scale_b), "--scale-s", str(args.scale_s), "--repeats", str(args.repeats),
              "--out", str(out / "testbed")], "kvpath testbed run")
    summary = json.loads((out / "testbed" / "summary.json").read_text())
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for s in summary["runs"]:
        rows[s.get("push_granularity", "request")].append(_row(s))
    console.rule("the serving simulation (flow backend), same trace and fabric")
    sim = json.loads(run([KVPATH, "bridge", "simulate", *common, "--backend", "flow", "--json"],
                          "kvpath bridge simulate").strip().splitlines()[-1])
    predicted = {("layer" if "+layer" in r["mode"] else "request"): r for r in sim}

    t = Table(title=f"layer-wise against request push, datacenter ms (ranges over {args.repeats} runs; "
                    f"{args.policy}, group {args.layer_group})")
    for c in ("variant", "valid", "TTFT mean", "TTFT p99", "TPOT mean", "push share", "P prefill p50",
              "push after prefill", "sim TTFT mean"):
        t.add_column(c, justify="left" if c == "variant" else "right")
    for v in VARIANTS:
        rs = [r for r in rows[v] if r["valid"]]
        t.add_row(v, f"{len(rs)}/{len(rows[v])}", span([r["ttft_mean"] for r in rs]),
                  span([r["ttft_p99"] for r in rs]), span([r["tpot_mean"] for r in rs], fmt="{:.2f}"),
                  span([r["push_share"] for r in rs], 100, "{:.0f}%"), span([r["prefill_p50"] for r in rs]),
                  span([r["push_after_prefill_mean"] for r in rs]), f"{predicted[v]['ttft_mean_s'] * 1e3:.1f}")
    console.print(t)
    pairs = [(a, b) for a in rows["request"] for b in rows["layer"] if a["repeat"] == b["repeat"]
             and a["valid"] and b["valid"]]
    gain = {k: [b[k] / a[k] - 1 for a, b in pairs] for k in ("ttft_mean", "ttft_p99", "tpot_mean", "prefill_p50")}
    for k, g in gain.items():
        console.print(f"layer vs request, {k}: {span(g, 100, '{:+.1f}%')} over {len(g)} repeat pairs")
    sim_gain = predicted["layer"]["ttft_mean_s"] / predicted["request"]["ttft_mean_s"] - 1
    console.print(f"the simulation predicts TTFT mean {sim_gain * 100:+.1f}% (uncalibrated)")
    across = _calibrated(out / "testbed", args.backends, console)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "gain": gain, "simulated": predicted,
                                               "simulated_gain": sim_gain, "calibrated": across, "args": vars(args)},
                                              indent=1))
    return 0


def _calibrated(runs: Path, backends: str, console: Console) -> list[dict]:
    """``kvpath bridge calibrate`` fitted on the request-granularity runs' traces, evaluated
    on the layer-wise ones (never fitted on): the replay's errors on each."""
    fit = sorted(str(p) for p in (runs / "cc").glob("*/trace.jsonl")) or [str(runs / "cc" / "trace.jsonl")]
    ev = sorted(str(p) for p in (runs / "cc+layer").glob("*/trace.jsonl")) or [str(runs / "cc+layer" / "trace.jsonl")]
    console.rule(f"calibrated on {len(fit)} request run(s), evaluated on {len(ev)} layer run(s)")
    res = []
    for b in backends.split(","):  # one at a time: a backend that fails does not hide the others
        r = subprocess.run([KVPATH, "bridge", "calibrate", *fit, "--evaluate", ",".join(ev), "--backend", b,
                            "--json"], capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.strip():
            console.print(f"[red]{b}: calibrate failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        res.extend(json.loads(r.stdout.strip().splitlines()[-1]))
    t = Table(title="replay of the layer-wise runs, calibrated on the request runs: error after calibration")
    for c in ("backend", "trace", "TTFT mean", "TTFT p99", "FCT mean", "FCT p99"):
        t.add_column(c, justify="left" if c in ("backend", "trace") else "right")
    for r in res:
        for e in r["evaluated"]:
            a, f = e["ttft"]["after"], e["fct"]["after"]
            t.add_row(r["backend"], Path(e["trace"]).parent.name, f"{a['mean'] * 100:+.1f}%", f"{a['p99'] * 100:+.1f}%",
                      f"{f['mean'] * 100:+.1f}%", f"{f['p99'] * 100:+.1f}%")
    console.print(t)
    return res


if __name__ == "__main__":
    sys.exit(main())
