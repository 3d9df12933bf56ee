"""``kvpath demo``: a small fabric, one workload under each variant, each trace replayed
in the bridge, one table and the HTML report."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import time
from pathlib import Path

from kvpath.demo.profiles import FULL, QUICK

logger = logging.getLogger(__name__)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole story in one command: a fabric, ecmp against cc, measured "
                                     "against simulated, the report",
                       description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help=f"the quick profile ({QUICK.fabric}, {QUICK.pools}, {QUICK.requests} requests; about 90 s) "
                        f"instead of the full one ({FULL.fabric}, {FULL.pools}, {FULL.requests} requests at "
                        f"{FULL.qps:g} QPS; under 10 minutes)")
    p.add_argument("--out", default="kvpath-demo",
                   help="folder for each variant's run, demo.json and the report (default: %(default)s)")
    p.add_argument("--no-ns3", action="store_true", help="replay in the flow model only (skip ns-3)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every variant N times, rotating the order per repeat (A B C, B C A, ...), each "
                        "run in <out>/<variant>/r<k>; the table gives medians over the valid runs and the notes "
                        "min..max (default %(default)s)")
    p.add_argument("--wide", action="store_true",
                   help="the wide table (every value, error and min..max) instead of one fitting 80 columns")
    p.add_argument("--simulate-only", action="store_true",
                   help="skip the testbed (as where no fabric can be built): the serving simulation alone")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvpath.demo.rows import table
    from kvpath.demo.steps import measure, replay, report_folders, simulate_only, write_json

    profile = QUICK if args.quick else FULL
    if args.repeats < 1:
        raise SystemExit("kvpath demo: error: --repeats: at least 1")
    if args.no_ns3:
        profile = dataclasses.replace(profile, ns3=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import sys

    # a log file or a pipe gets room for the wide table; the narrow one fits 80 columns anyway
    console = Console() if sys.stdout.isatty() else Console(width=200 if args.wide else 100)
    out = Path(args.out)
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwinds like Ctrl-C: every step cleans up
    try:
        out.mkdir(parents=True, exist_ok=True)
        why = "--simulate-only" if args.simulate_only else _fabric_problem()
        if why:
            console.print(f"[yellow]no fabric ({why}): running the simulation part alone[/yellow]")
            res, measured, failed = simulate_only(profile, out, console), False, 0
            folders = {r.variant: out / r.variant for r in res.rows}
            title = "simulated only (flow model), datacenter time (ms)"
        else:
            runs = measure(profile, out, console, args.repeats)
            backends = ["flow"] + (["ns3"] if profile.ns3 else [])
            res, measured = replay(runs, backends, console), True
            failed = sum(r.summary["failed"] for r in runs)
            folders = report_folders(runs)
            title = ("measured (testbed) against simulated, datacenter-equivalent time (ms); "
                     "errors: simulated / measured - 1" if args.wide else
                     "measured (testbed) against simulated, datacenter-equivalent ms; simulated rows: their error, "
                     "simulated / measured - 1")
        console.print(table(res.rows, title, wide=args.wide))
        for n in res.notes:
            console.print(n, highlight=False)
        write_json(out / "demo.json", res.rows, res.notes, measured, args.repeats)
        index = _report(out, folders, console)
        console.print(f"report: {index}" if index else "report: not written (see the log)")
        console.print(f"demo: {profile.name} profile in {time.monotonic() - t0:.0f} s; results in {out}/demo.json")
        return 0 if not failed else 1
    except Exception as e:  # a failed step ends the demo with one line, not a traceback
        logger.debug("the demo failed", exc_info=True)
        console.print(f"[red]kvpath demo: error: {e}[/red] (kvpath -v demo ... logs the traceback)")
        return 1
    except (KeyboardInterrupt, SystemExit) as e:
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 130
        console.print(f"[yellow]interrupted after {time.monotonic() - t0:.0f} s: the fabric and the engines "
                      "are torn down[/yellow]")
        return code


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _fabric_problem() -> str | None:
    from kvpath.testbed.netns_fabric import netns_problem

    return netns_problem()


def _report(out: Path, folders: dict[str, Path], console) -> Path | None:
    """The HTML report of one trace per variant (``kvpath bridge report``): its first
    valid run's."""
    from kvpath.bridge.report import write_report
    from kvpath.trace import TraceError, read_trace

    try:
        traces = [(v, read_trace(f / "trace.jsonl")) for v, f in folders.items()]
        console.rule("bridge: the report")
        return write_report(traces, out / "report").index
    except (OSError, ValueError, TraceError) as e:
        logger.warning("report not written: %s", e)
        return None
