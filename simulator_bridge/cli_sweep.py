"""What ``kvpath bridge sweep`` does with its parsed arguments (``cli.py`` declares them):
check every one up front (the error names the option), expand the grid, run it
(``sweep.py``) under a progress bar, print the rows as a table or JSON."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvpath.bridge.cli_args import fail, numbers, split
from kvpath.bridge.sweep import COORDS, Point, SweepError, connect_ray, expand_grid, import_ray, run_sweep, write_rows
from kvpath.deployment import parse_pools

logger = logging.getLogger(__name__)

VERB = "sweep"


def _check_config(backends: list[str], modes: list[str], lanes: int, reserve_at: str) -> None:
    """Backend and mode names as ServingConfig itself accepts them (so a backend added there is
    accepted here), checked on a fabric that two one-host pools fit, so only the name can fail."""
    from kvpath.bridge.serving_sim import MODES, ServingConfig
    from kvpath.fabric import FabricSpec

    probe = FabricSpec(leaves=2, spines=1, hosts_per_leaf=1)
    for flag, values, make in (
            ("--backend", backends, lambda b: ServingConfig(pools=(1, 1), mode=MODES[0], backend=b)),
            ("--mode", modes, lambda m: ServingConfig(pools=(1, 1), mode=m, backend=backends[0])),
            ("--lanes/--reserve-at", [None], lambda _: ServingConfig(pools=(1, 1), mode=MODES[0], backend=backends[0],
                                                                     lanes=lanes, reserve_at=reserve_at))):
        if not values:
            raise fail(VERB, f"{flag}: give at least one value")
        for v in values:
            try:
                make(v).validate(probe)
            except ValueError as e:
                raise fail(VERB, f"{flag}: {e}") from None


def points_from_args(args: argparse.Namespace) -> list[Point]:
    """Validate every argument up front (the flag named in the error) and expand the grid."""
    from kvpath.fabric import FabricSpec, FabricSpecError
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.models import ModelSpecError
    from kvpath.workloads import WorkloadError, load_workload

    qps = numbers(args.qps, VERB, "--qps", lambda v: v > 0, "> 0")
    delays = numbers(args.dc_delay_s, VERB, "--dc-delay-s", lambda v: v >= 0, ">= 0")
    backends, modes = split(args.backend), split(args.mode)
    _check_config(backends, modes, args.lanes, args.reserve_at)
    fabrics: dict[str, dict[str, Any]] = {}
    for name in split(args.fabric):
        try:
            fabrics[name] = FabricSpec.resolve(name).to_dict()
        except FabricSpecError as e:
            raise fail(VERB, f"--fabric: {e}") from None
    if not fabrics:
        raise fail(VERB, "--fabric: give at least one value")
    pools = split(args.pools)
    for p in pools or [""]:
        try:
            parse_pools(p)
        except ValueError as e:
            raise fail(VERB, f"--pools: {e}") from None
    if args.requests < 1:
        raise fail(VERB, f"--requests must be >= 1, got {args.requests}")
    if not args.scale_s > 0:
        raise fail(VERB, f"--scale-s must be > 0, got {args.scale_s}")
    if args.ns3_mtu is not None and not 576 <= args.ns3_mtu <= 65535:
        raise fail(VERB, f"--ns3-mtu must be in [576, 65535], got {args.ns3_mtu}")
    if args.workers is not None and args.workers < 1:
        raise fail(VERB, f"--workers must be >= 1, got {args.workers}")
    try:
        IterationTimeModel.preset(args.model, args.accelerator)
    except (ModelSpecError, KeyError, ValueError) as e:
        raise fail(VERB, f"--model/--accelerator: {e}") from None
    try:  # once here, so a bad workload is an argument error rather than every point's
        if not load_workload(args.workload, n=args.requests, qps=qps[0], seed=args.seed, min_prompt=args.min_prompt,
                             max_prompt=args.max_prompt, pd_ratio=args.pd_ratio).requests:
            raise WorkloadError(f"workload {args.workload!r} has no requests")
    except WorkloadError as e:
        raise fail(VERB, f"--workload: {e}") from None
    # a workload file by its absolute path: a Ray worker need not run in the driver's directory
    workload = str(Path(args.workload).resolve()) if Path(args.workload).is_file() else args.workload
    return expand_grid(fabrics=fabrics, pools=pools, backends=backends, modes=modes, dc_delays=delays, qps=qps,
                       workload=workload, requests=args.requests, seed=args.seed, min_prompt=args.min_prompt,
                       max_prompt=args.max_prompt, pd_ratio=args.pd_ratio, model=args.model,
                       accelerator=args.accelerator, lanes=args.lanes, reserve_at=args.reserve_at,
                       scale_s=args.scale_s, ns3_mtu=args.ns3_mtu)


def _ms(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v * 1e3:.{digits}f}"


def _coord_text(name: str, v: Any) -> str:
    if name == "dc_delay_s":
        return _ms(v, 1)
    return f"{v:g}" if name == "qps" else str(v)


def sweep_table(rows: list[dict[str, Any]], title: str, wide: bool = False) -> Any:
    """The rows as a table. A coordinate with one value in the whole grid goes into the
    title, so the table fits a terminal; the narrow view also pairs mean and p99 in one
    cell."""
    from rich import box
    from rich.table import Table

    heads = {"fabric": "fabric", "pools": "pools", "backend": "backend", "mode": "mode", "dc_delay_s": "dc ms",
             "qps": "QPS"}
    varying = [c for c in COORDS if len({r[c] for r in rows}) > 1]
    fixed = [f"{heads[c]} {_coord_text(c, rows[0][c])}" for c in COORDS if c not in varying and rows]
    t = Table(title=", ".join([title, *fixed]), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    stats = (["FCT", "FCT p99", "slowdn", "TTFT", "TTFT p99", "TPOT", "wall s"] if wide else
             ["FCT mean/p99", "slowdn", "TTFT mean/p99", "TPOT", "wall s"])
    for c in [*(heads[c] for c in varying), *stats]:
        t.add_column(c, no_wrap=True)
    for r in rows:
        coords = [_coord_text(c, r[c]) for c in varying]
        if r["error"]:
            t.add_row(*coords, "[red]failed[/red]")
            continue
        fct, ttft = [_ms(r["fct_mean_s"]), _ms(r["fct_p99_s"])], [_ms(r["ttft_mean_s"], 1), _ms(r["ttft_p99_s"], 1)]
        slow = "-" if r["slowdown_mean"] is None else f"{r['slowdown_mean']:.2f}"
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.2f}"
        if wide:
            t.add_row(*coords, *fct, slow, *ttft, _ms(r["tpot_mean_s"]), wall)
        else:
            t.add_row(*coords, "/".join(fct), slow, "/".join(ttft), _ms(r["tpot_mean_s"]), wall)
    return t


def print_table(rows: list[dict[str, Any]], title: str, wide: bool = False) -> None:
    """The rows, then each distinct error with how many points it ended (rows keep the full text)."""
    from collections import Counter

    from rich.console import Console

    t = sweep_table(rows, title, wide)
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would assume 80 columns and cut a wide grid's numbers
        console = Console(width=240)
    console.print(t)
    for err, n in Counter(r["error"] for r in rows if r["error"]).items():
        console.print(f"[red]{n} point(s) failed:[/red] {err}", highlight=False)


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        return _sweep(args)
    except SweepError as e:  # Ray missing or unreachable: the message names --ray
        raise fail(VERB, str(e)) from None


def _sweep(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    points = points_from_args(args)
    procs = min(args.workers or os.cpu_count() or 1, len(points))
    logger.info("sweep: %d points, %s", len(points),
                f"Ray ({args.ray})" if args.ray else "inline" if procs == 1 else f"{procs} processes")
    t0 = time.perf_counter()
    # connect before the progress bar starts: a cluster that does not answer is an argument error
    owned = connect_ray(args.ray, args.workers) if args.ray else False
    if args.ray:
        logger.info("sweep: Ray ready in %.1f s", time.perf_counter() - t0)
    failed = 0
    try:
        # on stderr, so --json's stdout stays machine-readable
        with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[failed]} failed"), console=Console(stderr=True)) as progress:
            task = progress.add_task("sweep", total=len(points), failed=0)

            def on_row(_: Point, row: dict[str, Any]) -> None:
                nonlocal failed
                failed += bool(row["error"])
                progress.update(task, advance=1, failed=failed)

            rows = run_sweep(points, workers=args.workers, ray_address=args.ray, on_row=on_row)
    finally:
        if owned:
            import_ray().shutdown()
    logger.info("sweep: %d points in %.1f s, %d failed", len(rows), time.perf_counter() - t0, failed)
    if args.out:
        write_rows(rows, args.out)
        logger.info("sweep: rows written to %s", args.out)
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
    else:
        print_table(rows, f"sweep: {args.workload}, {args.requests} requests, {args.model} on {args.accelerator} (ms)",
                    args.wide)
    return 1 if failed else 0
