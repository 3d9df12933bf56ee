"""``kvpath bridge sweep``: a grid of serving simulations, run in parallel, locally or on Ray.

The grid is the cartesian product of the comma lists (fabric x pools x backend x mode x
QPS), with ``--dc-delay-s`` a coordinate of the ``dc`` points only. Every point is one
``serving_sim.simulate`` + ``summarize``, done by ``run_point``: a top-level function
that takes a small picklable ``Point`` and returns a plain dict, so the same function
runs inline, in a spawned process pool, or as a Ray task. Each point builds its own
workload from (workload, requests, qps, seed, ...), so nothing big crosses a process
boundary. A point that fails gives a row with its error; the others go on.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator

from kvpath.bridge.cli_args import add_workload_args

logger = logging.getLogger(__name__)

PROG = "kvpath bridge sweep"
COORDS = ("fabric", "pools", "backend", "mode", "dc_delay_s", "qps")  # also the table's sort order
METRICS = ("requests", "fct_mean_s", "fct_p99_s", "slowdown_mean", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s",
           "wall_s")
COLUMNS = (*COORDS, *METRICS, "error")
RAY_HINT = "pip install -r requirements/ray.txt"


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {msg}")


@dataclass(frozen=True)
class Point:
    """One grid point and everything a worker needs to rebuild its inputs (all plain values)."""

    index: int  # position in the grid's expansion order, which is also the result order
    fabric: str  # the name given on the command line
    fabric_spec: dict[str, Any]  # resolved by the driver, so a spec file need not exist on a Ray node
    pools: str
    backend: str
    mode: str
    dc_delay_s: float | None  # None: not a coordinate of ecmp/cc points
    qps: float
    workload: str = "zipf"
    requests: int = 500
    seed: int = 0
    min_prompt: int = 1024
    max_prompt: int = 4096
    pd_ratio: float = 20.0
    model: str = "llama-3-8b"
    accelerator: str = "h100"
    lanes: int = 4
    reserve_at: str = "admission"
    scale_s: float = 1.0  # KV bytes divided by S
    ns3_mtu: int | None = None  # the ns3 backend's link MTU (None: the fabric's)

    def coords(self) -> dict[str, Any]:
        return {"fabric": self.fabric, "pools": self.pools, "backend": self.backend, "mode": self.mode,
                "dc_delay_s": self.dc_delay_s, "qps": self.qps}


Results = Generator[tuple[Point, dict[str, Any]], None, None]  # (point, its row), as points finish


def parse_pools(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)P(\d+)D", text)
    if not m:
        raise ValueError(f"pools must look like 8P8D, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def expand_grid(*, fabrics: dict[str, dict[str, Any]], pools: list[str], backends: list[str], modes: list[str],
                dc_delays: list[float], qps: list[float], **fixed: Any) -> list[Point]:
    """The grid in expansion order: fabric > pools > backend > mode > dc delay > QPS, each
    list in its given order. ``fixed`` are the Point fields every point shares."""
    points: list[Point] = []
    for fabric, spec in fabrics.items():
        for pool in pools:
            for backend in backends:
                for mode in modes:
                    # the delay only changes what dc does: one ecmp/cc run per other coordinate
                    for delay in (dc_delays if mode == "dc" else [None]):
                        for q in qps:
                            points.append(Point(index=len(points), fabric=fabric, fabric_spec=spec, pools=pool,
                                                backend=backend, mode=mode, dc_delay_s=delay, qps=q, **fixed))
    return points


def _error_row(point: Point, error: str) -> dict[str, Any]:
    return {**point.coords(), **dict.fromkeys(METRICS), "error": error}


def run_point(point: Point) -> dict[str, Any]:
    """One simulation: the point's coordinates + summarize()'s metrics, or its error.
    Never raises for a failing simulation, so one bad point cannot end the sweep."""
    from kvpath.fabric import FabricSpec
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.workloads import load_workload
    from kvpath.bridge.ns3_backend import Ns3Params
    from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize

    try:
        spec = FabricSpec.from_dict(point.fabric_spec)
        cfg = ServingConfig(pools=parse_pools(point.pools), mode=point.mode, backend=point.backend, lanes=point.lanes,
                            reserve_at=point.reserve_at, dc_delay_s=point.dc_delay_s or 0.0, scale_s=point.scale_s,
                            ns3=Ns3Params(mtu=point.ns3_mtu))
        cfg.validate(spec)  # before building the workload: a point that cannot run fails fast
        itm = IterationTimeModel.preset(point.model, point.accelerator)
        w = load_workload(point.workload, n=point.requests, qps=point.qps, seed=point.seed,
                          min_prompt=point.min_prompt, max_prompt=point.max_prompt, pd_ratio=point.pd_ratio)
        trace, info = simulate(spec, list(w.requests), cfg, itm)
        s = summarize(trace, info["wall_s"])
    except Exception as e:  # any failure is this point's result, reported in its row
        logger.debug("point %s failed", point.coords(), exc_info=True)
        return _error_row(point, f"{type(e).__name__}: {e}")
    return {**point.coords(), **{k: s.get(k) for k in METRICS}, "error": None}


# ---- executors: each yields (point, row) as points finish ----------------------------------


def iter_inline(points: list[Point]) -> Results:
    for p in points:
        yield p, run_point(p)


def iter_processes(points: list[Point], workers: int) -> Results:
    import multiprocessing

    # spawn, not fork: the driver has threads (rich's progress refresh), which fork does not copy safely
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(points)), mp_context=ctx) as ex:
        futures: dict[Future, Point] = {ex.submit(run_point, p): p for p in points}
        try:
            for fut in as_completed(futures):
                p = futures[fut]
                try:
                    yield p, fut.result()
                except Exception as e:  # the worker process died (BrokenProcessPool) or the result did not unpickle
                    yield p, _error_row(p, f"{type(e).__name__}: {e}")
        finally:
            ex.shutdown(wait=True, cancel_futures=True)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise _fail(f"--ray needs the ray package, which is not installed: {RAY_HINT}") from None
    return ray


def connect_ray(address: str, num_cpus: int | None) -> bool:
    """Connect to (or start) Ray; True when this call initialized it, so the caller shuts it down.
    A session that is already initialized (e.g. by a test or a notebook) is reused as it is."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False)
        else:
            import kvpath
            import kvpath.bridge

            # a cluster's nodes need not have this project installed: ship its two packages with the job
            ray.init(address=address, runtime_env={"py_modules": [kvpath, simulator_bridge],
                                                   "excludes": ["__pycache__", "*.pyc"]})
    except (ConnectionError, RuntimeError, ValueError) as e:
        # Ray's own message does not say so: a cluster with token authentication (the default of a
        # cluster that ray.init() starts) refuses a driver that is not in token mode
        hint = "; with token authentication, set RAY_AUTH_MODE=token (docs/sweep.md)" \
            if isinstance(e, ConnectionError) else ""
        raise _fail(f"--ray {address}: {type(e).__name__}: {e}{hint}") from None
    return True


def iter_ray(points: list[Point]) -> Results:
    ray = import_ray()
    remote = ray.remote(num_cpus=1)(run_point)
    refs = {remote.remote(p): p for p in points}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            p = refs[done[0]]
            try:
                yield p, ray.get(done[0])
            except Exception as e:  # the task's worker died, or Ray could not run it
                yield p, _error_row(p, f"{type(e).__name__}: {e}")
    finally:
        for ref in pending:  # stopped early (e.g. Ctrl-C): do not leave the cluster busy
            ray.cancel(ref)


def run_sweep(points: list[Point], workers: int | None = None, ray_address: str | None = None,
              on_row: Callable[[Point, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """All points' rows, in grid order. ``ray_address``: ``local``, ``auto`` or ``ray://host:port``
    (``workers``: the CPUs of a ``local`` instance, default all); without it, ``workers`` processes
    (default the CPU count; 1: inline). ``on_row`` sees each row as it arrives."""
    shutdown = False
    n = workers or os.cpu_count() or 1
    if ray_address is not None:
        shutdown = connect_ray(ray_address, workers)
        it: Results = iter_ray(points)
    elif n <= 1 or len(points) <= 1:
        it = iter_inline(points)
    else:
        it = iter_processes(points, n)
    rows: dict[int, dict[str, Any]] = {}
    try:
        for p, row in it:
            rows[p.index] = row
            if row["error"]:
                logger.warning("point %s failed: %s", p.coords(), row["error"])
            if on_row:
                on_row(p, row)
    finally:
        it.close()  # runs the executor's own clean-up (cancel what is pending) before Ray goes away
        if shutdown:
            import_ray().shutdown()
    return [rows[i] for i in sorted(rows)]


# ---- output -----------------------------------------------------------------------------


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> None:
    """CSV, or JSON lines when the name ends in .jsonl; columns are COLUMNS."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        if path.suffix == ".jsonl":
            for r in rows:
                f.write(json.dumps({c: r.get(c) for c in COLUMNS}) + "\n")
        else:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({c: "" if r.get(c) is None else r.get(c) for c in COLUMNS})


def _ms(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v * 1e3:.{digits}f}"


def _coord_text(name: str, v: Any) -> str:
    if name == "dc_delay_s":
        return _ms(v, 1)
    return f"{v:g}" if name == "qps" else str(v)


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    """The rows, then each distinct error with how many points it ended (rows keep the full text).
    A coordinate with one value in the whole grid goes into the title, so the table fits a terminal."""
    from collections import Counter

    from rich import box
    from rich.console import Console
    from rich.table import Table

    heads = {"fabric": "fabric", "pools": "pools", "backend": "backend", "mode": "mode", "dc_delay_s": "dc ms",
             "qps": "QPS"}
    varying = [c for c in COORDS if len({r[c] for r in rows}) > 1]
    fixed = [f"{heads[c]} {_coord_text(c, rows[0][c])}" for c in COORDS if c not in varying and rows]
    t = Table(title=", ".join([title, *fixed]), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for c in [*(heads[c] for c in varying), "FCT", "FCT p99", "slowdn", "TTFT", "TTFT p99", "TPOT", "wall s"]:
        t.add_column(c, no_wrap=True)
    for r in rows:
        coords = [_coord_text(c, r[c]) for c in varying]
        if r["error"]:
            t.add_row(*coords, "[red]failed[/red]")
            continue
        t.add_row(*coords, _ms(r["fct_mean_s"]), _ms(r["fct_p99_s"]),
                  "-" if r["slowdown_mean"] is None else f"{r['slowdown_mean']:.2f}",
                  _ms(r["ttft_mean_s"], 1), _ms(r["ttft_p99_s"], 1), _ms(r["tpot_mean_s"]),
                  "-" if r["wall_s"] is None else f"{r['wall_s']:.2f}")
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would assume 80 columns and cut the numbers
        console = Console(width=240)
    console.print(t)
    for err, n in Counter(r["error"] for r in rows if r["error"]).items():
        console.print(f"[red]{n} point(s) failed:[/red] {err}", highlight=False)


# ---- the command ------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))  # order kept, repeats dropped


def _numbers(text: str, flag: str, ok: Callable[[float], bool], want: str) -> list[float]:
    out = []
    for x in _split(text):
        try:
            v = float(x)
        except ValueError:
            raise _fail(f"{flag}: not a number: {x!r}") from None
        if not math.isfinite(v) or not ok(v):
            raise _fail(f"{flag}: each value must be {want}, got {x!r}")
        out.append(v)
    if not out:
        raise _fail(f"{flag}: give at least one value")
    return list(dict.fromkeys(out))


def _check_config(backends: list[str], modes: list[str], lanes: int, reserve_at: str) -> None:
    """Backend and mode names as ServingConfig itself accepts them (so a backend added there is
    accepted here), checked on a fabric that two one-host pools fit, so only the name can fail."""
    from kvpath.fabric import FabricSpec
    from kvpath.bridge.serving_sim import MODES, ServingConfig

    probe = FabricSpec(leaves=2, spines=1, hosts_per_leaf=1)
    for flag, values, make in (
            ("--backend", backends, lambda b: ServingConfig(pools=(1, 1), mode=MODES[0], backend=b)),
            ("--mode", modes, lambda m: ServingConfig(pools=(1, 1), mode=m, backend=backends[0])),
            ("--lanes/--reserve-at", [None], lambda _: ServingConfig(pools=(1, 1), mode=MODES[0], backend=backends[0],
                                                                     lanes=lanes, reserve_at=reserve_at))):
        if not values:
            raise _fail(f"{flag}: give at least one value")
        for v in values:
            try:
                make(v).validate(probe)
            except ValueError as e:
                raise _fail(f"{flag}: {e}") from None


def points_from_args(args: argparse.Namespace) -> list[Point]:
    """Validate every argument up front (the flag named in the error) and expand the grid."""
    from kvpath.fabric import FabricSpec, FabricSpecError
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.models import ModelSpecError
    from kvpath.workloads import WorkloadError, load_workload

    qps = _numbers(args.qps, "--qps", lambda v: v > 0, "> 0")
    delays = _numbers(args.dc_delay_s, "--dc-delay-s", lambda v: v >= 0, ">= 0")
    backends, modes = _split(args.backend), _split(args.mode)
    _check_config(backends, modes, args.lanes, args.reserve_at)
    fabrics: dict[str, dict[str, Any]] = {}
    for name in _split(args.fabric):
        try:
            fabrics[name] = FabricSpec.resolve(name).to_dict()
        except FabricSpecError as e:
            raise _fail(f"--fabric: {e}") from None
    if not fabrics:
        raise _fail("--fabric: give at least one value")
    pools = _split(args.pools)
    for p in pools or [""]:
        try:
            parse_pools(p)
        except ValueError as e:
            raise _fail(f"--pools: {e}") from None
    if args.requests < 1:
        raise _fail(f"--requests must be >= 1, got {args.requests}")
    if not args.scale_s > 0:
        raise _fail(f"--scale-s must be > 0, got {args.scale_s}")
    if args.ns3_mtu is not None and not 576 <= args.ns3_mtu <= 65535:
        raise _fail(f"--ns3-mtu must be in [576, 65535], got {args.ns3_mtu}")
    if args.workers is not None and args.workers < 1:
        raise _fail(f"--workers must be >= 1, got {args.workers}")
    try:
        IterationTimeModel.preset(args.model, args.accelerator)
    except (ModelSpecError, KeyError, ValueError) as e:
        raise _fail(f"--model/--accelerator: {e}") from None
    try:  # once here, so a bad workload is an argument error rather than every point's
        if not load_workload(args.workload, n=args.requests, qps=qps[0], seed=args.seed, min_prompt=args.min_prompt,
                             max_prompt=args.max_prompt, pd_ratio=args.pd_ratio).requests:
            raise WorkloadError(f"workload {args.workload!r} has no requests")
    except WorkloadError as e:
        raise _fail(f"--workload: {e}") from None
    # a workload file by its absolute path: a Ray worker need not run in the driver's directory
    workload = str(Path(args.workload).resolve()) if Path(args.workload).is_file() else args.workload
    return expand_grid(fabrics=fabrics, pools=pools, backends=backends, modes=modes, dc_delays=delays, qps=qps,
                       workload=workload, requests=args.requests, seed=args.seed, min_prompt=args.min_prompt,
                       max_prompt=args.max_prompt, pd_ratio=args.pd_ratio, model=args.model,
                       accelerator=args.accelerator, lanes=args.lanes, reserve_at=args.reserve_at,
                       scale_s=args.scale_s, ns3_mtu=args.ns3_mtu)


def _cmd_sweep(args: argparse.Namespace) -> int:
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
        print_table(rows, f"sweep: {args.workload}, {args.requests} requests, {args.model} on {args.accelerator} (ms)")
    return 1 if failed else 0


def add_parser(br: argparse._SubParsersAction) -> None:
    """Add ``sweep`` to the ``kvpath bridge`` subcommands."""
    s = br.add_parser("sweep", help="a grid of serving simulations, in parallel processes or on Ray",
                      description="Comma lists make a grid (their cartesian product); --dc-delay-s varies dc points "
                                  "only. One serving simulation per point (docs/sweep.md).")
    s.add_argument("--qps", default="6", help="comma list of arrival rates")
    s.add_argument("--dc-delay-s", default="0", help="comma list of dc decision delays (dc points only)")
    s.add_argument("--fabric", default="rack4", help="comma list: presets (small, rack4, rack8) or spec files")
    s.add_argument("--pools", default="8P8D", help="comma list, e.g. 4P4D,8P8D")
    s.add_argument("--backend", default="trivial,flow", help="comma list of network backends (flow, trivial, ...)")
    s.add_argument("--mode", default="ecmp,cc,dc", help="comma list: ecmp, cc, dc")
    add_workload_args(s)
    s.add_argument("--lanes", type=int, default=4)
    s.add_argument("--scale-s", type=float, default=1.0, help="KV bytes divided by S (1: the datacenter's)")
    s.add_argument("--ns3-mtu", type=int, default=None, help="the ns3 backend's link MTU (default: the fabric's)")
    s.add_argument("--reserve-at", default="admission", choices=("admission", "push"))
    s.add_argument("--workers", type=int, default=None,
                   help="local processes (default: the CPU count; 1: inline); with --ray local, the instance's CPUs")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the points as Ray tasks: local (start an instance), auto, or ray://host:port")
    s.add_argument("--out", default=None, help="write the rows as CSV, or JSON lines if the name ends in .jsonl")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    s.set_defaults(func=_cmd_sweep)
