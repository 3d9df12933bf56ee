"""``kvpath bridge ...``: measured traces against simulation. Every verb's arguments are
declared here; what each verb does is in ``cli_commands.py`` (``cli_sweep.py`` for
``sweep``), the shared argument groups in ``cli_args.py``."""

from __future__ import annotations

import argparse

from kvpath.bridge.backends import names as backend_names
from kvpath.bridge.cli_args import add_ns3_args, add_workload_args
from kvpath.bridge.cli_commands import cmd_calibrate, cmd_compare, cmd_convert, cmd_report, cmd_simulate
from kvpath.bridge.cli_sweep import cmd_sweep
from kvpath.bridge.convert import FORMATS as CONVERT_FORMATS
from kvpath.bridge.report import DEFAULT_DELAYS
from kvpath.bridge.serving_sim import ADMISSION
from kvpath.layer_push import PUSH_ORDERS
from kvpath.reservation.wire import MODES, RESERVE_AT

__all__ = ["add_parsers"]

_MODES = ", ".join(MODES)


def _backends() -> str:
    """The registered network backends, as the help lists them."""
    return ", ".join(backend_names())


def _add_compare(br: argparse._SubParsersAction) -> None:
    c = br.add_parser("compare", help="replay a trace's KV flows through network backends and print the FCT errors")
    c.add_argument("trace", help="a kvpath trace (trace.jsonl, docs/trace.md)")
    c.add_argument("--backend", default="flow,trivial", help=f"comma-separated: {_backends()}")
    c.add_argument("--overhead-s", type=float, default=0.0, help="fixed cost per flow added to its FCT")
    c.add_argument("--efficiency", type=float, default=1.0, help="share of a link's rate a flow's payload gets")
    c.add_argument("--cold-s", type=float, default=0.0,
                   help="added to the FCT of each lane's first flow (its five-tuple's first in the trace)")
    c.add_argument("--burst-bytes", type=int, default=None,
                   help="depth of every link's token bucket, in bytes (default: the trace's, else 0)")
    c.add_argument("--json", action="store_true", help="print the errors as JSON")
    add_ns3_args(c)
    c.add_argument("--wide", action="store_true",
                   help="the wide table (every column) instead of one fitting 80 columns")
    c.set_defaults(func=cmd_compare)


def _add_calibrate(br: argparse._SubParsersAction) -> None:
    k = br.add_parser("calibrate", help="fit the network and compute constants on part of a trace, or on whole "
                                        "traces of a fabric (--evaluate); held-out errors before and after")
    k.add_argument("trace", nargs="+", help="kvpath traces (trace.jsonl, docs/trace.md): one, split by time; or, "
                                            "with --evaluate, the traces to fit on, whole")
    k.add_argument("--evaluate", default=None,
                   help="comma-separated traces of the same fabric to report the errors on (never fitted on)")
    k.add_argument("--backend", default="flow", help=f"comma-separated: {_backends()}")
    k.add_argument("--train-frac", type=float, default=0.5,
                   help="the first share of requests by arrival that the fit sees (the rest is held out)")
    k.add_argument("--burst-bytes", type=int, default=None,
                   help="the links' token-bucket burst (default: the trace header's; fitted when neither gives it)")
    k.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    add_ns3_args(k)
    k.add_argument("--wide", action="store_true",
                   help="the wide table (every column) instead of one fitting 80 columns")
    k.set_defaults(func=cmd_calibrate)


def _add_simulate(br: argparse._SubParsersAction) -> None:
    s = br.add_parser("simulate", help="the two-phase P/D serving simulation, per mode and backend")
    s.add_argument("--fabric", default="rack4", help="preset (small, rack3, rack4, rack4-os2, rack8) or a JSON/YAML spec file")
    s.add_argument("--pools", default="8P8D", help="P and D engines, e.g. 4P4D (default %(default)s)")
    add_workload_args(s)
    s.add_argument("--qps", type=float, default=6.0,
                   help="request arrival rate, requests/s (a trace file is rescaled to it) (default %(default)s)")
    s.add_argument("--mode", default=",".join(MODES), help=f"comma-separated: {_MODES}")
    s.add_argument("--backend", default="trivial,flow", help=f"comma-separated: {_backends()}")
    s.add_argument("--scale-s", type=float, default=1.0, help="KV bytes divided by S (1: the datacenter's)")
    s.add_argument("--lanes", type=int, default=4,
                   help="lanes per P-D pair; lane k crosses spine k mod spines (default %(default)s)")
    s.add_argument("--reserve-at", default=ADMISSION, choices=RESERVE_AT,
                   help="when a push's lane is reserved: at the request's arrival (admission) or when its "
                        "prefill ends (push) (default %(default)s)")
    s.add_argument("--dc-delay-s", type=float, default=0.0,
                   help="dc mode: seconds before an agent sees other P hosts' reservations (default %(default)s)")
    s.add_argument("--push-granularity", default="request",
                   help="when P's KV leaves: request (one flow after the prefill), layer (one flow per layer "
                        "group as the prefill computes it), or both comma-separated (rows <mode>+layer)")
    s.add_argument("--layer-group", type=int, default=4, help="layer-wise: layers per flow (default %(default)s)")
    s.add_argument("--placement", default="round_robin",
                   help="who chooses P, D and the lane: round_robin (P and D in turn, the lane by --mode), or the "
                        "reservation service's placement at each arrival: joint, network, load (docs/placement.md); "
                        "several comma-separated (rows <mode>/<placement>)")
    s.add_argument("--uplink-pushes", type=int, default=0,
                   help="whole pushes in flight per P host's uplink, at most (the connector's uplink_pushes; 0: no "
                        "cap; flow backend only) (default %(default)s)")
    s.add_argument("--push-order", choices=PUSH_ORDERS, default=PUSH_ORDERS[0],
                   help="with --uplink-pushes: which waiting push takes a freed slot (default %(default)s)")
    s.add_argument("--push-queue-max-wait-s", type=float, default=0.2,
                   help="with --uplink-pushes: a push waits at most this long, simulated seconds (default %(default)s)")
    s.add_argument("--out", default=None, help="write each run's trace here as <backend>-<mode>.jsonl")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    add_ns3_args(s)
    s.add_argument("--wide", action="store_true",
                   help="the wide table (every column) instead of one fitting 80 columns")
    s.set_defaults(func=cmd_simulate)


def _add_convert(br: argparse._SubParsersAction) -> None:
    c = br.add_parser("convert", help="a trace from one format to another: kvpath, parquet, simai, fct, hpcc, "
                                      "request-metrics (docs/formats.md)")
    c.add_argument("input", metavar="IN", help="the file (or Parquet directory) to read")
    c.add_argument("output", metavar="OUT", help="the file (or Parquet directory) to write")
    c.add_argument("--from", dest="src_fmt", choices=CONVERT_FORMATS, default=None,
                   help="IN's format (default: guessed from its name, or a CSV's header)")
    c.add_argument("--to", dest="dst_fmt", choices=CONVERT_FORMATS, default=None,
                   help="OUT's format (default: from its name)")
    c.add_argument("--fabric", default=None,
                   help="preset (small, rack3, rack4, rack4-os2, rack8) or spec file mapping node ids to hosts, for simai and hpcc "
                        "(default: a kvpath or Parquet input's header)")
    c.add_argument("--json", action="store_true", help="print what was written as JSON")
    c.set_defaults(func=cmd_convert)


def _add_report(br: argparse._SubParsersAction) -> None:
    r = br.add_parser("report", help="an HTML page with figures of traces: timelines, slowdowns, a dc delay sweep")
    r.add_argument("trace", nargs="+", help="kvpath traces (docs/trace.md); the first one's workload is swept")
    r.add_argument("--out", required=True, help="directory for index.html and its PNGs")
    r.add_argument("--backend", default="flow",
                   help=f"network backend of the measured-vs-simulated replay: {_backends()}")
    r.add_argument("--dc-delays", default=",".join(f"{d:g}" for d in DEFAULT_DELAYS),
                   help="comma-separated dc broadcast delays in seconds (trace clock)")
    r.add_argument("--gantt-requests", default="40", help="requests per timeline (the first by arrival)")
    r.set_defaults(func=cmd_report)


def _add_sweep(br: argparse._SubParsersAction) -> None:
    s = br.add_parser("sweep", help="a grid of serving simulations, in parallel processes or on Ray",
                      description="Comma lists make a grid (their cartesian product); --dc-delay-s varies dc points "
                                  "only. One serving simulation per point (docs/sweep.md).")
    s.add_argument("--qps", default="6", help="comma list of arrival rates")
    s.add_argument("--dc-delay-s", default="0", help="comma list of dc decision delays (dc points only)")
    s.add_argument("--fabric", default="rack4", help="comma list: presets (small, rack3, rack4, rack4-os2, rack8) or spec files")
    s.add_argument("--pools", default="8P8D", help="comma list, e.g. 4P4D,8P8D")
    s.add_argument("--backend", default="trivial,flow", help="comma list of network backends (flow, trivial, ...)")
    s.add_argument("--mode", default=",".join(MODES), help=f"comma list: {_MODES}")
    add_workload_args(s)
    s.add_argument("--lanes", type=int, default=4,
                   help="lanes per P-D pair; lane k crosses spine k mod spines (default %(default)s)")
    s.add_argument("--scale-s", type=float, default=1.0, help="KV bytes divided by S (1: the datacenter's)")
    s.add_argument("--ns3-mtu", type=int, default=None, help="the ns3 backend's link MTU (default: the fabric's)")
    s.add_argument("--reserve-at", default=ADMISSION, choices=RESERVE_AT,
                   help="when a push's lane is reserved: at the request's arrival (admission) or when its "
                        "prefill ends (push) (default %(default)s)")
    s.add_argument("--workers", type=int, default=None,
                   help="local processes (default: the CPU count; 1: inline); with --ray local, the instance's CPUs")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the points as Ray tasks: local (start an instance), auto, or ray://host:port")
    s.add_argument("--out", default=None, help="write the rows as CSV, or JSON lines if the name ends in .jsonl")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    s.add_argument("--wide", action="store_true",
                   help="the wide table (every column) instead of one fitting 80 columns")
    s.set_defaults(func=cmd_sweep)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``bridge`` and its verbs to the ``kvpath`` subcommands."""
    br = sub.add_parser("bridge", help="measured traces against simulation").add_subparsers(dest="bridge_cmd")
    for add in (_add_compare, _add_calibrate, _add_simulate, _add_convert, _add_report, _add_sweep):
        add(br)
