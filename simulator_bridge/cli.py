"""``kvpath bridge ...``: measured traces against simulation."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

BURST_META = "burst_bytes"  # the testbed's token-bucket burst, in a trace header's meta


def _cmd_compare(args: argparse.Namespace) -> int:
    from kvpath.trace import TraceError, read_trace
    from simulator_bridge.compare import BACKENDS, compare_fct
    from simulator_bridge.flow_model import NetParams

    backends = [b for b in args.backend.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise SystemExit(f"kvpath bridge compare: error: --backend: choose from {', '.join(BACKENDS)}, got {args.backend!r}")
    try:
        trace = read_trace(args.trace)
    except (OSError, TraceError) as e:
        raise SystemExit(f"kvpath bridge compare: error: {args.trace}: {e}") from None
    burst = args.burst_bytes if args.burst_bytes is not None else int(trace.header.meta.get(BURST_META, 0))
    try:
        params = NetParams(overhead_s=args.overhead_s, efficiency=args.efficiency, burst_bytes=burst)
        errors = compare_fct(trace, backends, params)
    except ValueError as e:
        raise SystemExit(f"kvpath bridge compare: error: {e}") from None
    if args.json:
        sys.stdout.write(json.dumps({b: e.to_dict() for b, e in errors.items()}) + "\n")
        return 0
    t = Table(title=f"FCT, simulated vs measured ({trace.header.mode}, {len(trace.flows)} flows): relative error")
    for c in ("backend", "mean", "p50", "p99", "per-flow bias (median)", "per-flow |error| (mean)"):
        t.add_column(c)
    for b, e in errors.items():
        t.add_row(b, *(f"{100 * v:+.1f}%" for v in (e.mean, e.p50, e.p99, e.bias)), f"{100 * e.mean_abs:.1f}%")
    Console().print(t)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    br = sub.add_parser("bridge", help="measured traces against simulation").add_subparsers(dest="bridge_cmd")
    c = br.add_parser("compare", help="replay a trace's KV flows through network backends and print the FCT errors")
    c.add_argument("trace", help="a kvpath trace (trace.jsonl, docs/trace.md)")
    c.add_argument("--backend", default="flow,trivial", help="comma-separated: flow, trivial")
    c.add_argument("--overhead-s", type=float, default=0.0, help="fixed cost per flow added to its FCT")
    c.add_argument("--efficiency", type=float, default=1.0, help="share of a link's rate a flow's payload gets")
    c.add_argument("--burst-bytes", type=int, default=None,
                   help="bytes a flow sends at once before the link rate applies (default: the trace's, else 0)")
    c.add_argument("--json", action="store_true", help="print the errors as JSON")
    c.set_defaults(func=_cmd_compare)
