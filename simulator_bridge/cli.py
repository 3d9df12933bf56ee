"""``kvpath bridge ...``: measured traces against simulation."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvpath.bridge.cli_args import add_workload_args

if TYPE_CHECKING:
    from kvpath.trace import Trace

BURST_META = "burst_bytes"  # the testbed's token-bucket burst, in a trace header's meta
QUEUE_META = "queue_bytes"  # the testbed's buffer per egress port, in a trace header's meta
DEFAULT_NS3_QUEUE = 16 << 20  # deep: a lossless approximation where no trace says otherwise


def _ns3_params(args: argparse.Namespace, cmd: str, trace: Trace | None = None):
    """The ns3 options; the queue per port is the trace header's when the run recorded
    it (a testbed trace), so ns-3 drops where the testbed's links would."""
    from kvpath.bridge.ns3_backend import Ns3Params

    queue = args.ns3_queue_bytes
    if queue is None:
        queue = int(trace.header.meta.get(QUEUE_META, DEFAULT_NS3_QUEUE)) if trace is not None else DEFAULT_NS3_QUEUE
    try:
        return Ns3Params(mtu=args.ns3_mtu, queue_bytes=queue, tcp=args.ns3_tcp)
    except ValueError as e:
        raise SystemExit(f"kvpath bridge {cmd}: error: --ns3-*: {e}") from None


def _add_ns3_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ns3-mtu", type=int, default=None,
                   help="ns3 backend: link MTU (default: the fabric's; up to 65535 for coarse segments)")
    p.add_argument("--ns3-queue-bytes", type=int, default=None,
                   help="ns3 backend: drop-tail queue per port (default: the trace header's queue_bytes, else 16 MiB)")
    p.add_argument("--ns3-tcp", default="TcpCubic", help="ns3 backend: TCP variant (ns-3 type name)")


def _load_trace(path: str, cmd: str):
    from kvpath.trace import TraceError, read_trace

    try:
        return read_trace(path)
    except (OSError, TraceError) as e:
        raise SystemExit(f"kvpath bridge {cmd}: error: {path}: {e}") from None


def _backends(arg: str, cmd: str) -> list[str]:
    from kvpath.bridge.compare import BACKENDS

    backends = [b for b in arg.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise SystemExit(f"kvpath bridge {cmd}: error: --backend: choose from {', '.join(BACKENDS)}, got {arg!r}")
    return backends


def _pct(v: float) -> str:
    return f"{100 * v:+.1f}%"


def _cmd_compare(args: argparse.Namespace) -> int:
    from kvpath.bridge.compare import compare
    from kvpath.bridge.flow_model import NetParams
    from kvpath.bridge.ns3_backend import Ns3Error

    backends = _backends(args.backend, "compare")
    trace = _load_trace(args.trace, "compare")
    burst = args.burst_bytes if args.burst_bytes is not None else int(trace.header.meta.get(BURST_META, 0))
    try:
        params = NetParams(overhead_s=args.overhead_s, efficiency=args.efficiency, burst_bytes=burst)
        errors = compare(trace, backends, params, _ns3_params(args, "compare", trace))
    except (ValueError, Ns3Error) as e:
        raise SystemExit(f"kvpath bridge compare: error: {e}") from None
    if args.json:
        sys.stdout.write(json.dumps({b: {q: (e.to_dict() if e else None) for q, e in row.items()}
                                     for b, row in errors.items()}) + "\n")
        return 0
    t = Table(title=f"simulated vs measured ({trace.header.mode}, {len(trace.flows)} flows): relative error")
    for c in ("backend", "quantity", "n", "mean", "p50", "p99", "bias (median)", "|error| (mean)"):
        t.add_column(c)
    for b, row in errors.items():
        for q, e in row.items():
            if e is not None:
                t.add_row(b, q.upper(), str(e.n), *(_pct(v) for v in (e.mean, e.p50, e.p99, e.bias)),
                          f"{100 * e.mean_abs:.1f}%")
    Console().print(t)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvpath.bridge.calibrate import calibrate
    from kvpath.bridge.ns3_backend import Ns3Error

    backends = _backends(args.backend, "calibrate")
    trace = _load_trace(args.trace, "calibrate")
    if args.burst_bytes is not None and args.burst_bytes < 0:
        raise SystemExit(f"kvpath bridge calibrate: error: --burst-bytes must be >= 0, got {args.burst_bytes}")
    ns3 = _ns3_params(args, "calibrate", trace)
    results = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  disable=args.json, transient=True) as prog:
        task = prog.add_task("calibrating", total=None)
        for b in backends:
            try:
                results.append(calibrate(trace, b, args.train_frac, ns3, burst_bytes=args.burst_bytes,
                                         progress=lambda msg: prog.update(task, description=msg)))
            except (ValueError, Ns3Error) as e:
                raise SystemExit(f"kvpath bridge calibrate: error: {e}") from None
    if args.json:
        sys.stdout.write(json.dumps([r.to_dict() for r in results]) + "\n")
        return 0
    c = Console()
    for r in results:
        t = Table(title=f"{r.backend}: held-out error ({r.held_requests} requests; fitted on the first "
                        f"{r.train_requests} by arrival, {r.runs} network runs)")
        for col in ("quantity", "mean before", "mean after", "p99 before", "p99 after", "bias after"):
            t.add_column(col)
        for q in ("fct", "ttft", "tpot"):
            h = getattr(r, q)
            t.add_row(q.upper(), _pct(h.before.mean), _pct(h.after.mean), _pct(h.before.p99), _pct(h.after.p99),
                      _pct(h.after.bias))
        c.print(t)
        n, k = r.net, r.compute
        c.print(f"  network: overhead_s={n.overhead_s:.6f} efficiency={n.efficiency} burst_bytes={n.burst_bytes}; "
                f"compute: iteration_overhead_s={k.iteration_overhead_s} speed={k.speed} "
                f"request_overhead_s={k.request_overhead_s:.6f}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import re
    from pathlib import Path

    from kvpath.fabric import FabricSpec, FabricSpecError
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.models import ModelSpecError
    from kvpath.trace import TraceWriter
    from kvpath.workloads import WorkloadError, load_workload
    from kvpath.bridge.ns3_backend import Ns3Error
    from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"kvpath bridge simulate: error: {msg}")

    try:
        spec = FabricSpec.resolve(args.fabric)
    except FabricSpecError as e:
        raise fail(f"--fabric: {e}") from None
    m = re.fullmatch(r"(\d+)P(\d+)D", args.pools)
    if not m:
        raise fail(f"--pools must look like 8P8D, got {args.pools!r}")
    try:
        itm = IterationTimeModel.preset(args.model, args.accelerator)
    except (ModelSpecError, KeyError, ValueError) as e:
        raise fail(f"--model/--accelerator: {e}") from None
    try:
        w = load_workload(args.workload, n=args.requests, qps=args.qps, seed=args.seed, min_prompt=args.min_prompt,
                          max_prompt=args.max_prompt, pd_ratio=args.pd_ratio)
    except WorkloadError as e:
        raise fail(f"--workload: {e}") from None
    rows = []
    for backend in [b for b in args.backend.split(",") if b]:
        for mode in [x for x in args.mode.split(",") if x]:
            cfg = ServingConfig(pools=(int(m.group(1)), int(m.group(2))), mode=mode, backend=backend, lanes=args.lanes,
                                reserve_at=args.reserve_at, dc_delay_s=args.dc_delay_s, scale_s=args.scale_s,
                                ns3=_ns3_params(args, "simulate"))
            try:
                trace, info = simulate(spec, list(w.requests), cfg, itm)
            except (ValueError, Ns3Error) as e:
                raise fail(str(e)) from None
            rows.append(summarize(trace, info["wall_s"]))
            if args.out:
                out = Path(args.out) / f"{backend}-{mode}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                with TraceWriter(out, trace.header) as tw:
                    for rec in [*trace.requests, *trace.flows]:
                        tw.write(rec)
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    t = Table(title=f"simulated: {args.fabric}, {args.pools}, {len(w.requests)} requests at {args.qps} QPS (ms)")
    for c in ("backend", "mode", "FCT mean", "FCT p99", "slowdown mean", "TTFT mean", "TPOT mean", "wall (s)"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["backend"], r["mode"], f"{r['fct_mean_s'] * 1e3:.2f}", f"{r['fct_p99_s'] * 1e3:.2f}",
                  f"{r['slowdown_mean']:.2f}", f"{r['ttft_mean_s'] * 1e3:.1f}", f"{r['tpot_mean_s'] * 1e3:.2f}",
                  f"{r['wall_s']:.2f}")
    Console().print(t)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    br = sub.add_parser("bridge", help="measured traces against simulation").add_subparsers(dest="bridge_cmd")
    c = br.add_parser("compare", help="replay a trace's KV flows through network backends and print the FCT errors")
    c.add_argument("trace", help="a kvpath trace (trace.jsonl, docs/trace.md)")
    c.add_argument("--backend", default="flow,trivial", help="comma-separated: flow, trivial, ns3")
    c.add_argument("--overhead-s", type=float, default=0.0, help="fixed cost per flow added to its FCT")
    c.add_argument("--efficiency", type=float, default=1.0, help="share of a link's rate a flow's payload gets")
    c.add_argument("--burst-bytes", type=int, default=None,
                   help="bytes a flow sends at once before the link rate applies (default: the trace's, else 0)")
    c.add_argument("--json", action="store_true", help="print the errors as JSON")
    _add_ns3_args(c)
    c.set_defaults(func=_cmd_compare)

    k = br.add_parser("calibrate", help="fit the network and compute constants on part of a trace; "
                                        "held-out errors before and after")
    k.add_argument("trace", help="a kvpath trace (trace.jsonl, docs/trace.md)")
    k.add_argument("--backend", default="flow", help="comma-separated: flow, trivial, ns3")
    k.add_argument("--train-frac", type=float, default=0.5,
                   help="the first share of requests by arrival that the fit sees (the rest is held out)")
    k.add_argument("--burst-bytes", type=int, default=None,
                   help="the links' token-bucket burst (default: the trace header's; fitted when neither gives it)")
    k.add_argument("--json", action="store_true")
    _add_ns3_args(k)
    k.set_defaults(func=_cmd_calibrate)

    s = br.add_parser("simulate", help="the two-phase P/D serving simulation, per mode and backend")
    s.add_argument("--fabric", default="rack4", help="preset (small, rack4, rack8) or a JSON/YAML spec file")
    s.add_argument("--pools", default="8P8D")
    add_workload_args(s)
    s.add_argument("--qps", type=float, default=6.0)
    s.add_argument("--mode", default="ecmp,cc,dc", help="comma-separated: ecmp, cc, dc")
    s.add_argument("--backend", default="trivial,flow", help="comma-separated: flow, trivial, ns3")
    s.add_argument("--scale-s", type=float, default=1.0, help="KV bytes divided by S (1: the datacenter's)")
    s.add_argument("--lanes", type=int, default=4)
    s.add_argument("--reserve-at", default="admission", choices=("admission", "push"))
    s.add_argument("--dc-delay-s", type=float, default=0.0)
    s.add_argument("--out", default=None, help="write each run's trace here as <backend>-<mode>.jsonl")
    s.add_argument("--json", action="store_true")
    _add_ns3_args(s)
    s.set_defaults(func=_cmd_simulate)

    from kvpath.bridge import convert, report, sweep

    convert.add_parser(br)
    report.add_parser(br)
    sweep.add_parser(br)
