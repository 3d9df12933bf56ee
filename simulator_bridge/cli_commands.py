"""What ``kvpath bridge compare``, ``calibrate``, ``simulate``, ``convert`` and ``report``
do with their parsed arguments (``cli.py`` declares them): check what the library does
not, call it, print the result. Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from rich.console import Console

from kvpath.bridge.cli_args import backends, fail, load_trace, ns3_params
from kvpath.bridge.tables import across_table, calibrate_table, compare_table, simulate_table
from kvpath.trace import Trace


def _console(args: argparse.Namespace) -> Console:
    """The terminal's console; piped or captured, room for the wide table (rich would
    assume 80 columns, which only the narrow one is made to fit)."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


def cmd_compare(args: argparse.Namespace) -> int:
    from kvpath.bridge.compare import compare_replays
    from kvpath.bridge.flow_model import NetParams
    from kvpath.bridge.ns3_backend import Ns3Error
    from kvpath.trace.header import TraceSetup

    names = backends(args.backend, "compare")
    trace = load_trace(args.trace, "compare")
    try:
        # the testbed links' token bucket from the header; the other constants are the ones under test
        burst = args.burst_bytes if args.burst_bytes is not None else TraceSetup(trace).burst_bytes or 0
        params = NetParams(overhead_s=args.overhead_s, efficiency=args.efficiency, burst_bytes=burst,
                           cold_s=args.cold_s)
        replays = compare_replays(trace, names, params, ns3_params(args, "compare", trace))
        measured_drops = TraceSetup(trace).drops  # the testbed's, when the trace recorded them
    except (ValueError, Ns3Error) as e:
        raise fail("compare", str(e)) from None
    errors = {b: r.errors() for b, r in replays.items()}
    if args.json:
        sys.stdout.write(json.dumps({b: {**{q: (e.to_dict() if e else None) for q, e in row.items()},
                                         "drops": {"measured": measured_drops, "simulated": replays[b].drops}}
                                     for b, row in errors.items()}) + "\n")
        return 0
    c = _console(args)
    c.print(compare_table(f"simulated vs measured ({trace.header.mode}, {len(trace.flows)} flows): relative error",
                          errors, args.wide))
    sim = ", ".join(f"{b} {r.drops}" for b, r in replays.items() if r.drops is not None)
    c.print(f"packets dropped: testbed {'not recorded' if measured_drops is None else measured_drops}"
                    + (f"; {sim}" if sim else ""))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvpath.bridge.calibrate import calibrate

    names = backends(args.backend, "calibrate")
    if args.burst_bytes is not None and args.burst_bytes < 0:
        raise fail("calibrate", f"--burst-bytes must be >= 0, got {args.burst_bytes}")
    if args.evaluate is not None:
        return _calibrate_across(args, names)
    if len(args.trace) != 1:
        raise fail("calibrate", f"give one trace to split by time, or the traces to fit on with --evaluate "
                                f"(got {len(args.trace)} and no --evaluate)")
    trace = load_trace(args.trace[0], "calibrate")
    ns3 = ns3_params(args, "calibrate", trace)
    results = _per_backend(args, names, lambda b, progress: calibrate(
        trace, b, args.train_frac, ns3, burst_bytes=args.burst_bytes, progress=progress))
    if args.json:
        sys.stdout.write(json.dumps([r.to_dict() for r in results]) + "\n")
        return 0
    c = _console(args)
    for r in results:
        c.print(calibrate_table(f"{r.backend}: held-out error ({r.held_requests} requests; fitted on the first "
                                f"{r.train_requests} by arrival, {r.runs} network runs)",
                                [(q, getattr(r, q)) for q in ("fct", "ttft", "tpot")], args.wide))
        _print_constants(c, r.net, r.compute)
    return 0


def _print_constants(c: Console, n: Any, k: Any) -> None:
    c.print(f"  network: overhead_s={n.overhead_s:.6f} cold_s={n.cold_s:.6f} efficiency={n.efficiency} "
            f"burst_bytes={n.burst_bytes}; "
            f"compute: iteration_wall_s={k.iteration_wall_s} speed={k.speed} "
            f"request_overhead_s={k.request_overhead_s:.6f} front_end_s={k.front_end_s:.6f}")


def _per_backend(args: argparse.Namespace, names: list[str], run: Any) -> list[Any]:
    """``run(backend, progress)`` for each backend under one spinner (none with --json);
    a ValueError or an ns-3 failure ends the command naming it."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kvpath.bridge.ns3_backend import Ns3Error

    results = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  disable=args.json, transient=True) as prog:
        task = prog.add_task("calibrating", total=None)
        for b in names:
            try:
                results.append(run(b, lambda msg: prog.update(task, description=msg)))
            except (ValueError, Ns3Error) as e:
                raise fail("calibrate", str(e)) from None
    return results


def _calibrate_across(args: argparse.Namespace, names: list[str]) -> int:
    """``calibrate FIT... --evaluate A,B``: fit on whole traces, report every evaluated one."""
    from kvpath.bridge.calibrate_across import calibrate_across

    evaluate = [p for p in args.evaluate.split(",") if p]
    if not evaluate:
        raise fail("calibrate", "--evaluate: give at least one trace")
    fit = [(p, load_trace(p, "calibrate")) for p in args.trace]
    ev = [(p, load_trace(p, "calibrate")) for p in evaluate]
    ns3 = ns3_params(args, "calibrate", fit[0][1])
    results = _per_backend(args, names, lambda b, progress: calibrate_across(
        fit, ev, b, ns3, burst_bytes=args.burst_bytes, progress=progress))
    if args.json:
        sys.stdout.write(json.dumps([r.to_dict() for r in results]) + "\n")
        return 0
    c = _console(args)
    for r in results:
        t, names = across_table(f"{r.backend}: fitted on {len(r.fit_traces)} trace(s), {r.runs} network runs; "
                                "error on each evaluated trace", r.evaluated, args.wide)
        c.print(t)
        for n in names:
            c.print(n, highlight=False)
        _print_constants(c, r.net, r.compute)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpath.bridge.ns3_backend import Ns3Error
    from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize
    from kvpath.deployment import parse_pools
    from kvpath.fabric import FabricSpec, FabricSpecError
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.layer_push import variant_label
    from kvpath.models import ModelSpecError
    from kvpath.trace import TraceWriter
    from kvpath.workloads import WorkloadError, load_workload

    try:
        spec = FabricSpec.resolve(args.fabric)
    except FabricSpecError as e:
        raise fail("simulate", f"--fabric: {e}") from None
    try:
        pools = parse_pools(args.pools)
    except ValueError as e:
        raise fail("simulate", f"--pools: {e}") from None
    try:
        itm = IterationTimeModel.preset(args.model, args.accelerator)
    except (ModelSpecError, KeyError, ValueError) as e:
        raise fail("simulate", f"--model/--accelerator: {e}") from None
    try:
        w = load_workload(args.workload, n=args.requests, qps=args.qps, seed=args.seed, min_prompt=args.min_prompt,
                          max_prompt=args.max_prompt, pd_ratio=args.pd_ratio)
    except WorkloadError as e:
        raise fail("simulate", f"--workload: {e}") from None
    rows = []
    grans = [g for g in args.push_granularity.split(",") if g]
    places = [p for p in args.placement.split(",") if p]
    for backend in [b for b in args.backend.split(",") if b]:
        for mode, gran, plc in [(x, g, p) for x in args.mode.split(",") if x for g in grans for p in places]:
            cfg = ServingConfig(pools=pools, mode=mode, backend=backend, lanes=args.lanes, reserve_at=args.reserve_at,
                                dc_delay_s=args.dc_delay_s, scale_s=args.scale_s, ns3=ns3_params(args, "simulate"),
                                push_granularity=gran, layer_group=args.layer_group,
                                placement="" if plc == "round_robin" else plc, uplink_pushes=args.uplink_pushes,
                                push_order=args.push_order, push_queue_max_wait_s=args.push_queue_max_wait_s)
            try:
                trace, info = simulate(spec, list(w.requests), cfg, itm)
            except (ValueError, Ns3Error) as e:
                raise fail("simulate", str(e)) from None
            rows.append(summarize(trace, info["wall_s"]))
            if args.out:
                name = variant_label(mode, gran) + ("" if plc == "round_robin" else f"-{plc}") + (
                    f"-{args.push_order}{args.uplink_pushes}" if args.uplink_pushes else "")
                out = Path(args.out) / f"{backend}-{name}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                with TraceWriter(out, trace.header) as tw:
                    tw.write_all([*trace.requests, *trace.flows])
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    _console(args).print(simulate_table(f"simulated: {args.fabric}, {args.pools}, {len(w.requests)} requests at "
                                        f"{args.qps} QPS (ms)", rows, args.wide))
    return 0


def _convert_summary(r: dict[str, object]) -> str:
    line = f"wrote {r['requests']} requests and {r['flows']} flows to {r['out']} ({r['to']}, from {r['from']})"
    left = [f"{r[f'dropped_{w}']} {w}" for w in ("requests", "flows") if r[f"dropped_{w}"]]
    return line + (f"; left out: {', '.join(left)} ({r['to']} cannot hold them)" if left else "")


def cmd_convert(args: argparse.Namespace) -> int:
    from kvpath.bridge.convert import ConvertError, convert
    from kvpath.fabric import FabricSpecError
    from kvpath.trace import TraceError

    try:
        r = convert(args.input, args.output, args.src_fmt, args.dst_fmt, args.fabric)
    except (ConvertError, TraceError, FabricSpecError) as e:
        raise fail("convert", str(e)) from None
    except OSError as e:
        raise fail("convert", f"{e.filename or ''}: {e.strerror or e}") from None
    sys.stdout.write((json.dumps(r) if args.json else _convert_summary(r)) + "\n")
    return 0


def parse_delays(text: str) -> list[float]:
    """``0,0.001,...`` -> sorted distinct seconds; an error naming --dc-delays otherwise."""
    out = set()
    for x in (s.strip() for s in text.split(",")):
        if not x:
            continue
        try:
            v = float(x)
        except ValueError:
            raise fail("report", f"--dc-delays: not a number: {x!r}") from None
        if not math.isfinite(v) or v < 0:
            raise fail("report", f"--dc-delays: each delay must be a finite number of seconds >= 0, got {x!r}")
        out.add(v)
    if not out:
        raise fail("report", f"--dc-delays: give at least one delay, got {text!r}")
    return sorted(out)


def _report_trace(path: str) -> Trace:
    from kvpath.trace import TraceError, read_trace

    try:
        trace = read_trace(path)
    except TraceError as e:  # read_trace turns OSError into TraceError too
        raise fail("report", f"TRACE: {e}") from None
    if not trace.requests:
        raise fail("report", f"TRACE: {path}: empty trace (no requests)")
    return trace


def cmd_report(args: argparse.Namespace) -> int:
    from kvpath.bridge.report import write_report

    backends(args.backend, "report", one=True)
    try:
        n = int(args.gantt_requests)
    except ValueError:
        raise fail("report", f"--gantt-requests: not an integer: {args.gantt_requests!r}") from None
    if n < 1:
        raise fail("report", f"--gantt-requests must be >= 1, got {n}")
    delays = parse_delays(args.dc_delays)
    traces = [(p, _report_trace(p)) for p in args.trace]
    try:
        rep = write_report(traces, args.out, backend=args.backend, dc_delays=delays, gantt_requests=n)
    except OSError as e:
        raise fail("report", f"--out {args.out}: {e}") from None
    except ValueError as e:  # the arguments were checked above: this is a trace the report cannot read
        raise fail("report", str(e)) from None
    Console().print(f"report: {rep.index} ({sum(map(len, rep.figures.values()))} figures, {len(rep.notes)} notes)")
    return 0
