"""A grid of serving simulations, run in parallel, locally or on Ray (``kvpath bridge sweep``).

The grid is the cartesian product of the comma lists (fabric x pools x backend x mode x
QPS), with ``--dc-delay-s`` a coordinate of the ``dc`` points only. Every point is one
``serving_sim.simulate`` + ``summarize``, done by ``run_point``: a top-level function
that takes a small picklable ``Point`` and returns a plain dict, so the same function
runs inline, in a spawned process pool, or as a Ray task. Each point builds its own
workload from (workload, requests, qps, seed, ...), so nothing big crosses a process
boundary. A point that fails gives a row with its error; the others go on.

The command (its arguments, their checks, the table) is in ``cli_sweep.py``.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator

from kvpath.deployment import parse_pools
from kvpath.reservation.wire import RESERVE_AT

logger = logging.getLogger(__name__)

COORDS = ("fabric", "pools", "backend", "mode", "dc_delay_s", "qps")  # also the table's sort order
METRICS = ("requests", "fct_mean_s", "fct_p99_s", "slowdown_mean", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s",
           "wall_s")
COLUMNS = (*COORDS, *METRICS, "error")
RAY_HINT = "pip install -r requirements/ray.txt"


class SweepError(RuntimeError):
    """Ray cannot be imported or reached; the message names the ``--ray`` option."""


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
    reserve_at: str = RESERVE_AT[0]
    scale_s: float = 1.0  # KV bytes divided by S
    ns3_mtu: int | None = None  # the ns3 backend's link MTU (None: the fabric's)

    def coords(self) -> dict[str, Any]:
        return {"fabric": self.fabric, "pools": self.pools, "backend": self.backend, "mode": self.mode,
                "dc_delay_s": self.dc_delay_s, "qps": self.qps}


Results = Generator[tuple[Point, dict[str, Any]], None, None]  # (point, its row), as points finish


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
    from kvpath.bridge.ns3_backend import Ns3Params
    from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize
    from kvpath.fabric import FabricSpec
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.workloads import load_workload

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
        raise SweepError(f"--ray needs the ray package, which is not installed: {RAY_HINT}") from None
    return ray


def ray_package(into: Path) -> Path:
    """A copy of the ``kvpath`` package with the bridge in it (``kvpath/bridge``), in
    ``into``, for a Ray job's ``py_modules``: the installed tree maps ``kvpath.bridge``
    to another folder (``simulator_bridge/``), which Ray would ship under that folder's
    name. Only what a point imports: kvpath's shared modules and the bridge."""
    import kvpath
    import kvpath.bridge

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    pkg = into / "kvpath"
    shutil.copytree(Path(kvpath.__file__).parent, pkg, ignore=ignore)
    shutil.copytree(Path(kvpath.bridge.__file__).parent, pkg / "bridge", ignore=ignore)
    return pkg


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
            # a cluster's nodes need not have this project installed: ship kvpath with the job
            # (Ray uploads the folder at init, so it can go once ray.init returns)
            with tempfile.TemporaryDirectory(prefix="kvpath-ray-") as tmp:
                ray.init(address=address, runtime_env={"py_modules": [str(ray_package(Path(tmp)))]})
    except (ConnectionError, RuntimeError, ValueError) as e:
        # Ray's own message does not say so: a cluster with token authentication (the default of a
        # cluster that ray.init() starts) refuses a driver that is not in token mode
        hint = "; with token authentication, set RAY_AUTH_MODE=token (docs/sweep.md)" \
            if isinstance(e, ConnectionError) else ""
        raise SweepError(f"--ray {address}: {type(e).__name__}: {e}{hint}") from None
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
