"""Calibrate once per fabric, predict other workloads: fit the simulator's constants on
whole traces (``calibrate.FitSet.whole``) and report the error on other traces of the
same fabric, before (defaults) and after (the fitted constants).

The evaluated traces are never handed to the fit: :func:`calibrate_across` fits on
``fit`` alone and only then replays each evaluated trace, and it refuses an evaluated
trace whose records equal a fit trace's (the same run given twice).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from kvpath.bridge.calibrate import (FitSet, Held, check_burst, counting_run, fit_compute, fit_network,
                                     request_errors)
from kvpath.bridge.compare import Errors
from kvpath.bridge.flow_model import NetParams
from kvpath.bridge.ns3_backend import Ns3Params
from kvpath.bridge.request_replay import ComputeParams
from kvpath.fabric import FabricSpec
from kvpath.trace import Trace
from kvpath.trace.header import TraceSetup


@dataclass
class Evaluated:
    """One evaluated trace: its errors before and after calibration."""

    name: str
    flows: int
    requests: int
    fct: Held
    ttft: Held
    tpot: Held
    # TTFT with every request's front end the fitted constant (``front_end_s``), not its
    # measured one: the serving model's error with the front end predicted, too
    ttft_front_end_constant: Held | None = None

    def to_dict(self) -> dict[str, Any]:
        constant = self.ttft_front_end_constant
        return {"trace": self.name, "flows": self.flows, "requests": self.requests, "fct": self.fct.to_dict(),
                "ttft": self.ttft.to_dict(), "tpot": self.tpot.to_dict(),
                "ttft_front_end_constant": None if constant is None else constant.to_dict()}


@dataclass
class CrossCalibration:
    backend: str
    net: NetParams
    compute: ComputeParams
    fit_traces: list[str]
    evaluated: list[Evaluated] = field(default_factory=list)
    runs: int = 0  # network runs the fit took

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "net": dataclasses.asdict(self.net),
                "compute": dataclasses.asdict(self.compute), "fit_traces": self.fit_traces,
                "network_runs": self.runs, "evaluated": [e.to_dict() for e in self.evaluated]}


def trace_digest(trace: Trace) -> str:
    """The trace's records (header included), hashed: equal for the same run read twice."""
    return hashlib.sha256(msgspec.json.encode(trace)).hexdigest()


def _same_fabric(a: FabricSpec, b: FabricSpec) -> bool:
    """Equal specs, the link rates compared to float precision (a rate derived from a
    header's ratio may differ in its last bit)."""
    rates = ("host_link_gbps", "spine_link_gbps")
    if dataclasses.replace(a, **{r: 1.0 for r in rates}) != dataclasses.replace(b, **{r: 1.0 for r in rates}):
        return False
    return all(math.isclose(getattr(a, r), getattr(b, r), rel_tol=1e-9) for r in rates)


def _named(name: str, what: Callable[[], Any]) -> Any:
    """``what()``, a ValueError from it naming the trace."""
    try:
        return what()
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def check_sets(fit: list[tuple[str, Trace]], evaluate: list[tuple[str, Trace]], burst_bytes: int | None = None
               ) -> tuple[int | None, list[str]]:
    """ValueError naming the trace: no fit trace, no evaluated trace, a fabric that is not
    the first fit trace's (the constants are per fabric), links whose recorded burst or
    buffer differ from the first fit trace's (unless ``burst_bytes`` is given), an
    evaluated trace that is a fit trace. Returns the links' burst (``burst_bytes``, else the
    traces' recorded one; None when they record none: it is fitted) and each fit trace's
    :func:`trace_digest`."""
    if not fit or not evaluate:
        raise ValueError("calibration across traces needs at least one trace to fit on and one to evaluate")
    first = fit[0][0]
    ref = _named(first, lambda: TraceSetup(fit[0][1]))
    spec, burst, queue = _named(first, lambda: (ref.fabric, ref.burst_bytes, ref.queue_bytes))
    for name, t in fit + evaluate:
        setup = TraceSetup(t)
        if not _same_fabric(_named(name, lambda: setup.fabric), spec):
            raise ValueError(f"{name}: its fabric (at the rates its run had) is not {first}'s; calibrate per fabric")
        if burst_bytes is None and _named(name, lambda: setup.burst_bytes) != burst:
            raise ValueError(f"{name}: its links' burst ({setup.burst_bytes}) is not {first}'s ({burst}); "
                             "give --burst-bytes or calibrate per testbed setting")
        if _named(name, lambda: setup.queue_bytes) != queue:
            raise ValueError(f"{name}: its links' buffer ({setup.queue_bytes}) is not {first}'s ({queue})")
    digests = [trace_digest(t) for _, t in fit]
    fitted = {d: name for d, (name, _) in zip(digests, fit)}
    for name, t in evaluate:
        twin = fitted.get(trace_digest(t))
        if twin is not None:
            raise ValueError(f"{name} is also a fit trace ({twin}): evaluate on other runs")
    return (burst_bytes if burst_bytes is not None else burst), digests


NetCache = dict[tuple[str, str, NetParams, Any], np.ndarray]


def calibrate_across(fit: list[tuple[str, Trace]], evaluate: list[tuple[str, Trace]], backend: str,
                     ns3: Ns3Params | None = None, progress: Callable[[str], None] | None = None,
                     burst_bytes: int | None = None, cache: NetCache | None = None) -> CrossCalibration:
    """Fit on every flow and request of the ``fit`` traces (name, trace); then evaluate on
    each of ``evaluate``, every flow and request, with the defaults and with the fit, both
    at the links' burst (given, or the one every trace recorded).

    ``cache`` (a dict the caller keeps) holds each network run's FCTs by trace, backend
    and constants, so calls that share fit traces (leave-one-out over a fabric's traces)
    run each once; ``runs`` counts the runs this call made."""
    check_burst(burst_bytes)
    known, digests = check_sets(fit, evaluate, burst_bytes)
    sets = [_named(name, lambda: FitSet.whole(t)) for name, t in fit]
    net_run, runs = counting_run(backend, ns3, progress)
    if cache is not None:
        digest = {id(fs): d for fs, d in zip(sets, digests)}
        simulate_once = net_run

        def net_run(fs: FitSet, p: NetParams) -> np.ndarray:
            key = (digest.get(id(fs)) or "", backend, p, ns3)
            if not key[0]:  # an evaluated trace: its runs are not shared
                return simulate_once(fs, p)
            if key not in cache:
                cache[key] = simulate_once(fs, p)
                cache[key].setflags(write=False)  # shared by later calls
            return cache[key]
    net, _, fcts = fit_network(sets, backend, known, ns3, net_run)
    compute = fit_compute(sets, fcts)
    out = CrossCalibration(backend, net, compute, [name for name, _ in fit], runs=runs[0])
    for name, t in evaluate:  # the fit is done: nothing below changes it
        fs = _named(name, lambda: FitSet.whole(t))
        fct0 = _named(name, lambda: net_run(fs, NetParams(burst_bytes=net.burst_bytes)))  # same bucket as after
        fct1 = _named(name, lambda: net_run(fs, net))
        every = np.ones(len(fs.inp.reqs), dtype=bool)
        t0, p0 = request_errors(fs, ComputeParams(), fct0, every)
        t1, p1 = request_errors(fs, compute, fct1, every)
        c0, _ = request_errors(fs, ComputeParams(), fct0, every, measured_front_end=False)
        c1, _ = request_errors(fs, compute, fct1, every, measured_front_end=False)
        out.evaluated.append(Evaluated(name, len(fs.flows), len(fs.inp.reqs),
                                       Held(Errors.of(fs.measured, fct0), Errors.of(fs.measured, fct1)),
                                       Held(t0, t1), Held(p0, p1), Held(c0, c1)))
    return out
