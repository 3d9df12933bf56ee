"""Bridge benchmark: how fast the flow-level model sets up and runs, and flow vs ns-3.

    .venv/bin/python benchmarks/bench_bridge.py [--only setup,run,serving,ns3] [--json PATH]

Sections (``--only`` picks some; all by default):

setup    The flow model's set-up on fabrics of 1,024, 8,192 and 65,536 hosts: the link
         numbering, the capacities and the link ids of --flows flows; median (min-max)
         of --reps.
run      A run of --flows flows with random endpoints and spines, Poisson arrivals at a
         load where flows share links, on each fabric: wall time (median (min-max) of
         --run-reps) and mean FCT over standalone FCT.
serving  The serving simulation at the published study's shape (rack4, 100 Gbit/s, 8P8D,
         500 requests, Zipf 1024-4096, 6 QPS): wall time per mode.
ns3      flow vs ns3 on the same flows. A trace per load point (--qps, --link-gbps) and
         mode (--modes) from the serving simulation (flow backend, rack4, 8P8D,
         LLaMA-3-8B on H100); its flows, each on the spine the trace gives it, replayed
         by ``FlowModel`` and by ``Ns3Backend`` at MTU 9000 (the fabric's) and 65535, on
         the scale model: link rates / S and KV bytes / S (--ns3-scale), which leaves
         every flow-model FCT unchanged (checked) while ns-3's cost follows the bytes.
         Wall times (flow: median of --reps; ns3: median of --ns3-reps), ns3/flow, ns-3's
         drops and the flow-vs-ns3 error of mean and p99 FCT. ns-3 is also run at a
         second byte scale (--ns3-cost-scale) on each point's first mode, and its cost
         extrapolated linearly in bytes to S = 1 (the full-size trace).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpath.bridge import ns3_backend
from kvpath.bridge.compare import Errors, trace_flows
from kvpath.bridge.flow_model import FlowModel, FlowSpec, LinkIndex, trivial_fct
from kvpath.bridge.ns3_backend import Ns3Backend, Ns3Params
from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.reservation.wire import MODES
from kvpath.trace.header import TraceSetup
from kvpath.workloads import load_workload

# leaves, spines, hosts per leaf: 1,024, 8,192 and 65,536 hosts
FABRICS = {"1K": (8, 8, 128), "8K": (64, 32, 128), "64K": (256, 32, 256)}
SECTIONS = ("setup", "run", "serving", "ns3")
HEADER_BYTES = 52  # ns-3 segments carry MTU - 52 bytes of payload (IP + TCP with timestamps)


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


def fmt(v: list[float], digits: int = 3) -> str:
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def timed(fn: Callable[[], Any], reps: int) -> tuple[Any, list[float]]:
    """The last result and the wall time of each of ``reps`` calls."""
    walls, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return out, walls


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


# ---- setup and run -------------------------------------------------------------------
def section_setup_run(args: argparse.Namespace, console: Console, only: set[str]) -> list[dict[str, Any]]:
    do_setup, do_run = "setup" in only, "run" in only
    parts = [p for p, on in ((f"set-up (median (min-max) of {args.reps})", do_setup),
                             (f"a run of {args.flows} flows ({args.run_reps} rep(s))", do_run)) if on]
    t = Table(title="flow model: " + " and ".join(parts))
    for c in ("fabric", "hosts", "links", "set-up s", "run s", "mean FCT / alone"):
        t.add_column(c, justify="right")
    rows = []
    rng = np.random.default_rng(0)
    with progress_bar(console) as prog:
        task = prog.add_task("set-up and run", total=len(FABRICS))
        for name, (leaves, spines, hpl) in FABRICS.items():
            prog.update(task, description=f"fabric {name}")
            spec = FabricSpec(leaves=leaves, spines=spines, hosts_per_leaf=hpl)
            flows = random_flows(spec, args.flows, rng)
            setups: list[float] = []
            runs: list[float] = []
            ratio = None
            if do_setup:
                _, setups = timed(lambda: LinkIndex(spec).links(flows), args.reps)
            if do_run:
                fct, runs = timed(lambda: FlowModel(spec).run(flows), args.run_reps)
                ratio = float((fct / trivial_fct(spec, flows)).mean())
            n_links = LinkIndex(spec).n
            t.add_row(name, str(leaves * hpl), str(n_links), fmt(setups), fmt(runs),
                      "-" if ratio is None else f"{ratio:.2f}")
            rows.append({"fabric": name, "hosts": leaves * hpl, "links": n_links, "setup_s": setups, "run_s": runs,
                         "flows": args.flows, "mean_fct_over_alone": ratio})
            prog.advance(task)
    console.print(t)
    return rows


# ---- serving -------------------------------------------------------------------------
def section_serving(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    spec = FabricSpec.resolve("rack4")
    w = load_workload("zipf", n=500, qps=6.0, seed=0, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    s = Table(title="serving simulation, rack4 8P8D, 500 requests at 6 QPS: wall time per mode (s)")
    modes = MODES
    for c in ("backend", *modes):
        s.add_column(c, justify="right")
    rows = []
    for backend in ("trivial", "flow"):
        walls = []
        for mode in modes:
            _, info = simulate(spec, list(w.requests), ServingConfig(mode=mode, backend=backend),
                               IterationTimeModel.preset())
            walls.append(info["wall_s"])
            rows.append({"backend": backend, "mode": mode, "wall_s": info["wall_s"]})
        s.add_row(backend, *(f"{x:.2f}" for x in walls))
    console.print(s)
    return rows


# ---- flow vs ns3 ---------------------------------------------------------------------
def scale_fabric(spec: FabricSpec, s: float) -> FabricSpec:
    return dataclasses.replace(spec, host_link_gbps=spec.host_link_gbps / s, spine_link_gbps=spec.spine_link_gbps / s)


def scale_flows(flows: list[FlowSpec], s: float) -> list[FlowSpec]:
    return [dataclasses.replace(f, bytes=max(1, round(f.bytes / s))) for f in flows]


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a / b - 1).max())


def segments(flows: list[FlowSpec], mtu: int) -> int:
    per = mtu - HEADER_BYTES
    return int(sum(-(-f.bytes // per) for f in flows))


def section_ns3(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    gbps = args.link_gbps if len(args.link_gbps) == len(args.qps) else args.link_gbps * len(args.qps)
    if len(gbps) != len(args.qps):
        raise SystemExit("--link-gbps takes one rate, or one per --qps value")
    points = list(zip(args.qps, gbps))
    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    rack4 = FabricSpec.resolve("rack4")
    mtus = [rack4.mtu if m == 0 else m for m in args.ns3_mtu]
    base_params = Ns3Params(timeout_s=args.ns3_timeout, min_rto_ms=args.ns3_min_rto_ms)
    t0 = time.perf_counter()
    ns3_backend.binary()  # compiled on first use (~10 s): not part of any timing below
    compile_s = time.perf_counter() - t0
    console.print(f"[dim]ns-3 scenario ready ({compile_s:.1f} s, compile/cache lookup, not timed below)[/dim]")

    traces, runs, cost = [], [], []
    with progress_bar(console) as prog:
        # 1. the traces, once per point and mode
        built = []
        task = prog.add_task("serving simulation (traces)", total=len(points) * len(args.seeds) * len(args.modes))
        for (qps, g), seed in ((pt, sd) for pt in points for sd in args.seeds):
            spec_pt = dataclasses.replace(rack4, host_link_gbps=g, spine_link_gbps=g)
            w = load_workload("zipf", n=args.requests, qps=qps, seed=seed, min_prompt=1024, max_prompt=4096,
                              pd_ratio=20)
            for k, mode in enumerate(args.modes):
                trace, info = simulate(spec_pt, list(w.requests), ServingConfig(mode=mode, backend="flow"), itm)
                # only the first seed's first mode pays for the second (cost) scale
                built.append((qps, g, seed, mode, k == 0 and seed == args.seeds[0], trace,
                              summarize(trace, info["wall_s"])))
                prog.advance(task)
        prog.remove_task(task)

        n_ns3 = sum(len(mtus) * (1 + (first and args.ns3_cost_scale > 0)) for *_, first, _, _ in built)
        ns3_task = prog.add_task("ns-3 runs", total=n_ns3 * args.ns3_reps)
        for qps, g, seed, mode, first, trace, summ in built:
            spec = TraceSetup(trace).fabric
            flows, fct_trace = trace_flows(trace)
            label = f"{qps:g} QPS, {g:g}G" + (f", seed {seed}" if len(args.seeds) > 1 else "")
            # flow at full size (S = 1): its cost does not depend on the bytes
            fct_full, walls_full = timed(lambda: FlowModel(spec).run(flows), args.reps)
            scales = [args.ns3_scale] + ([args.ns3_cost_scale] if first and args.ns3_cost_scale > 0 else [])
            tr_row = {"point": label, "qps": qps, "link_gbps": g, "seed": seed, "mode": mode, "flows": len(flows),
                      "bytes": int(sum(f.bytes for f in flows)), "slowdown_mean": summ["slowdown_mean"],
                      "fct_mean_s": summ["fct_mean_s"], "fct_p99_s": summ["fct_p99_s"],
                      "replay_vs_trace_max_rel": max_rel(fct_full, fct_trace), "flow_s_full": walls_full,
                      "scaled_vs_full_max_rel": {}}
            for s in scales:
                sspec, sflows = scale_fabric(spec, s), scale_flows(flows, s)
                fct_s, walls_s = timed(lambda: FlowModel(sspec).run(sflows), args.reps)
                tr_row["scaled_vs_full_max_rel"][str(s)] = max_rel(fct_s, fct_full)
                for mtu in mtus:
                    params = dataclasses.replace(base_params, mtu=mtu)
                    results = []
                    for r in range(args.ns3_reps):
                        sub = prog.add_task(f"  {label} {mode} S={s:g} MTU {mtu} ({r + 1}/{args.ns3_reps})",
                                            total=len(sflows))

                        def cb(done: int, n: int, sub: Any = sub) -> None:
                            prog.update(sub, completed=done, total=n)

                        results.append(Ns3Backend(sspec, params=params).run(sflows, progress=cb))
                        prog.remove_task(sub)
                        prog.advance(ns3_task)
                    res = results[-1]
                    ns3_walls = [x.wall_s for x in results]
                    err = Errors.of(measured=res.fct_s, simulated=fct_s)
                    runs.append({"point": label, "qps": qps, "seed": seed, "mode": mode, "scale": s,
                                 "link_gbps": spec.host_link_gbps / s, "mtu": mtu, "bytes": int(sum(f.bytes for f in sflows)),
                                 "segments": segments(sflows, mtu), "flow_s": walls_s, "ns3_s": ns3_walls,
                                 "ratio": statistics.median(ns3_walls) / statistics.median(walls_s),
                                 "drops": res.drops, "errors": err.to_dict(),
                                 "ns3_fct_mean_s": float(res.fct_s.mean()),
                                 "ns3_fct_p99_s": float(np.percentile(res.fct_s, 99)),
                                 "flow_fct_mean_s": float(fct_s.mean()),
                                 "flow_fct_p99_s": float(np.percentile(fct_s, 99))})
            traces.append(tr_row)

    # extrapolation: per (trace, MTU) run at two byte scales, ns-3's wall = a + b * bytes
    for r1 in runs:
        if r1["scale"] != args.ns3_scale:
            continue
        r2 = next((r for r in runs if r["point"] == r1["point"] and r["mode"] == r1["mode"] and r["mtu"] == r1["mtu"]
                   and r["scale"] == args.ns3_cost_scale), None)
        if r2 is None:
            continue
        tr = next(t for t in traces if t["point"] == r1["point"] and t["mode"] == r1["mode"])
        w1, w2 = statistics.median(r1["ns3_s"]), statistics.median(r2["ns3_s"])
        per_byte = (w2 - w1) / (r2["bytes"] - r1["bytes"])
        full = w1 + per_byte * (tr["bytes"] - r1["bytes"])
        flow_full = statistics.median(tr["flow_s_full"])
        cost.append({"point": r1["point"], "mode": r1["mode"], "mtu": r1["mtu"],
                     "scales": [r1["scale"], r2["scale"]], "ns3_s": [w1, w2], "ratios": [r1["ratio"], r2["ratio"]],
                     "ns3_s_per_gb": per_byte * 1e9, "full_bytes": tr["bytes"],
                     "ns3_s_full_extrapolated": full, "flow_s_full": flow_full,
                     "ratio_full_extrapolated": full / flow_full})

    t = Table(title="ns3 section, the traces (serving simulation, flow backend, rack4 8P8D, "
                    f"{args.requests} requests, LLaMA-3-8B/H100): the flow model replays them exactly")
    for c in ("point", "mode", "flows", "KV GB", "FCT slowdown mean", "flow replay vs trace: max |rel|",
              "flow at S vs at S=1: max |rel|", "flow s at S=1"):
        t.add_column(c, justify="right")
    for tr in traces:
        t.add_row(tr["point"], tr["mode"], str(tr["flows"]), f"{tr['bytes'] / 1e9:.1f}",
                  f"{tr['slowdown_mean']:.3f}", f"{tr['replay_vs_trace_max_rel']:.1e}",
                  ", ".join(f"S={float(s):g}: {v:.1e}" for s, v in tr["scaled_vs_full_max_rel"].items()),
                  fmt(tr["flow_s_full"]))
    console.print(t)

    t = Table(title=f"flow vs ns3 on the same flows (scale model: link rates / S, KV bytes / S); wall s: flow "
                    f"median of {args.reps}, ns3 median of {args.ns3_reps}; err = flow / ns3 - 1")
    for c in ("point", "mode", "S", "Gbit/s", "MTU", "KV MB", "segments", "flow s", "ns3 s",
              "ns3/flow", "drops", "mean FCT ms flow / ns3", "err", "p99 FCT ms flow / ns3", "err"):
        t.add_column(c, justify="right")
    for r in runs:
        e = r["errors"]
        t.add_row(r["point"], r["mode"], f"{r['scale']:g}", f"{r['link_gbps']:g}", str(r["mtu"]),
                  f"{r['bytes'] / 1e6:.0f}", f"{r['segments']:,}", f"{statistics.median(r['flow_s']):.3f}",
                  f"{statistics.median(r['ns3_s']):.2f}",
                  f"{r['ratio']:.0f}x", str(r["drops"]),
                  f"{r['flow_fct_mean_s'] * 1e3:.2f} / {r['ns3_fct_mean_s'] * 1e3:.2f}", pct(e["mean"]),
                  f"{r['flow_fct_p99_s'] * 1e3:.2f} / {r['ns3_fct_p99_s'] * 1e3:.2f}", pct(e["p99"]))
    console.print(t)

    spread = seed_spread(runs) if len(args.seeds) > 1 else []
    if spread:
        t = Table(title=f"flow vs ns3 over seeds {','.join(map(str, args.seeds))}: error median (min..max)")
        for c in ("QPS", "Gbit/s", "mode", "S", "MTU", "seeds", "mean FCT err", "p99 FCT err", "|p99 err| <= 10%"):
            t.add_column(c, justify="right")
        for r in spread:
            t.add_row(f"{r['qps']:g}", f"{r['link_gbps']:g}", r["mode"], f"{r['scale']:g}", str(r["mtu"]),
                      str(r["n"]), rng_pct(r["mean"]), rng_pct(r["p99"]), f"{r['p99_within_10']}/{r['n']}")
        console.print(t)

    if cost:
        t = Table(title="ns-3's cost against bytes: measured at two byte scales, and EXTRAPOLATED to the full-size "
                        "trace (S=1) linearly in bytes (ns3 s = a + b x bytes through the two measured points)")
        for c in ("point", "mode", "MTU", "S", "ns3 s (measured)", "ns3/flow (measured)", "ns3 s per GB",
                  "KV GB at S=1", "ns3 s at S=1 (extrapolated)", "flow s at S=1 (measured)",
                  "ns3/flow at S=1 (extrapolated)"):
            t.add_column(c, justify="right")
        for c_ in cost:
            t.add_row(c_["point"], c_["mode"], str(c_["mtu"]), " / ".join(f"{s:g}" for s in c_["scales"]),
                      " / ".join(f"{w:.2f}" for w in c_["ns3_s"]), " / ".join(f"{x:.0f}x" for x in c_["ratios"]),
                      f"{c_['ns3_s_per_gb']:.2f}", f"{c_['full_bytes'] / 1e9:.1f}",
                      f"{c_['ns3_s_full_extrapolated']:.0f}", f"{c_['flow_s_full']:.3f}",
                      f"{c_['ratio_full_extrapolated']:.0f}x")
        console.print(t)
    return {"compile_s": compile_s, "traces": traces, "runs": runs, "cost_extrapolation": cost,
            "seed_spread": spread}


def seed_spread(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The flow-vs-ns3 errors of each (point, mode, S, MTU) over the seeds: a range, not one draw."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["qps"], r["link_gbps"] * r["scale"], r["mode"], r["scale"], r["mtu"]), []).append(r)
    out = []
    for (qps, g, mode, scale, mtu), rs in groups.items():
        mean, p99 = [r["errors"]["mean"] for r in rs], [r["errors"]["p99"] for r in rs]
        out.append({"qps": qps, "link_gbps": g, "mode": mode, "scale": scale, "mtu": mtu, "n": len(rs),
                    "mean": mean, "p99": p99, "p99_within_10": sum(abs(x) <= 0.10 for x in p99)})
    return out


def rng_pct(v: list[float]) -> str:
    return f"{pct(statistics.median(v))} ({pct(min(v))}..{pct(max(v))})"


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--flows", type=int, default=2000, help="flows of the set-up and run sections")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of set-up and of every flow-model timing")
    ap.add_argument("--run-reps", type=int, default=3,
                    help="repetitions of the run section")
    ap.add_argument("--qps", type=floats, default=[6.0, 30.0], help="load points of the ns3 section")
    ap.add_argument("--link-gbps", type=floats, default=[100.0, 20.0],
                    help="the fabric's link rate at each --qps point (one value: all)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES[:2]),
                    help="modes of the ns3 section's traces (the first also gets the cost scale)")
    ap.add_argument("--requests", type=int, default=500, help="requests of the ns3 section's traces")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",") if x.strip()], default=[0],
                    help="workload seeds of the ns3 section (several: a table of the error's range over them)")
    ap.add_argument("--ns3-scale", type=float, default=100.0, help="S = B: link rates and KV bytes divided by it")
    ap.add_argument("--ns3-cost-scale", type=float, default=20.0,
                    help="a second byte scale for ns-3's cost (each point's first mode); 0: none")
    ap.add_argument("--ns3-mtu", type=lambda s: [int(x) for x in s.split(",")], default=[0, 65535],
                    help="ns-3 MTUs (0: the fabric's, 9000)")
    ap.add_argument("--ns3-reps", type=int, default=1)
    ap.add_argument("--ns3-min-rto-ms", type=float, default=Ns3Params.min_rto_ms,
                    help="ns-3's minimum RTO (not scaled with S)")
    ap.add_argument("--ns3-timeout", type=float, default=1800.0, help="wall-clock limit of one ns-3 run (s)")
    ap.add_argument("--json", metavar="PATH",
                    help="also write every number as JSON (- for stdout; the tables then go to stderr)")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only or only - set(SECTIONS):
        ap.error(f"--only takes sections of {','.join(SECTIONS)}, got {args.only!r}")
    if args.ns3_cost_scale == args.ns3_scale:
        ap.error("--ns3-cost-scale must differ from --ns3-scale (0 for none)")
    console = Console(stderr=args.json == "-")
    if console.width < 170:  # the ns3 tables are wide: wrap lines rather than squash columns
        console = Console(stderr=args.json == "-", width=170)
    out: dict[str, Any] = {"args": vars(args)}
    t0 = time.perf_counter()
    if only & {"setup", "run"}:
        out["setup_run"] = section_setup_run(args, console, only)
    if "serving" in only:
        out["serving"] = section_serving(args, console)
    if "ns3" in only:
        out["ns3"] = section_ns3(args, console)
    out["total_s"] = time.perf_counter() - t0
    console.print(f"total {out['total_s']:.0f} s")
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
