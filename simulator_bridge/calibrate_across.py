"""Calibrate once per fabric, predict other workloads: fit the simulator's constants on
whole traces (``calibrate.FitSet.whole``) and report the error on other traces of the
same fabric, before (defaults) and after (the fitted constants).

The evaluated traces are never handed to the fit: :func:`calibrate_across` fits on
``fit`` alone and only then replays each evaluated trace, and it refuses an evaluated
trace whose records equal a fit trace's (the same run given twice).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from kvpath.bridge.calibrate import FitSet, Held, counting_run, known_burst_of, request_errors, fit_compute, fit_network
from kvpath.bridge.compare import Errors
from kvpath.bridge.flow_model import NetParams
from kvpath.bridge.ns3_backend import Ns3Params
from kvpath.bridge.request_replay import ComputeParams
from kvpath.trace import Trace
from kvpath.trace_header import TraceSetup


@dataclass
class Evaluated:
    """One evaluated trace: its errors before and after calibration."""

    name: str
    flows: int
    requests: int
    fct: Held
    ttft: Held
    tpot: Held

    def to_dict(self) -> dict[str, Any]:
        def held(h: Held) -> dict[str, Any]:
            return {"before": h.before.to_dict(), "after": h.after.to_dict()}

        return {"trace": self.name, "flows": self.flows, "requests": self.requests, "fct": held(self.fct),
                "ttft": held(self.ttft), "tpot": held(self.tpot)}


@dataclass
class CrossCalibration:
    backend: str
    net: NetParams
    compute: ComputeParams
    fit_traces: list[str]
    evaluated: list[Evaluated] = field(default_factory=list)
    runs: int = 0  # network runs the fit took

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return {"backend": self.backend, "net": dataclasses.asdict(self.net),
                "compute": dataclasses.asdict(self.compute), "fit_traces": self.fit_traces,
                "network_runs": self.runs, "evaluated": [e.to_dict() for e in self.evaluated]}


def trace_digest(trace: Trace) -> str:
    """The trace's records (header included), hashed: equal for the same run read twice."""
    return hashlib.sha256(msgspec.json.encode(trace)).hexdigest()


def check_sets(fit: list[tuple[str, Trace]], evaluate: list[tuple[str, Trace]]) -> None:
    """ValueError naming the trace: no fit trace, no evaluated trace, a fabric that is not
    the first fit trace's (the constants are per fabric), an evaluated trace that is a fit
    trace."""
    if not fit or not evaluate:
        raise ValueError("calibration across traces needs at least one trace to fit on and one to evaluate")
    spec = TraceSetup(fit[0][1]).fabric
    for name, t in fit + evaluate:
        if TraceSetup(t).fabric != spec:
            raise ValueError(f"{name}: its fabric (at the rates its run had) is not {fit[0][0]}'s; "
                             "calibrate per fabric")
    fitted = {trace_digest(t): name for name, t in fit}
    for name, t in evaluate:
        if trace_digest(t) in fitted:
            raise ValueError(f"{name} is also a fit trace ({fitted[trace_digest(t)]}): evaluate on other runs")


def calibrate_across(fit: list[tuple[str, Trace]], evaluate: list[tuple[str, Trace]], backend: str,
                     ns3: Ns3Params | None = None, progress: Callable[[str], None] | None = None,
                     burst_bytes: int | None = None) -> CrossCalibration:
    """Fit on every flow and request of the ``fit`` traces (name, trace); then evaluate on
    each of ``evaluate``, every flow and request, with the defaults and with the fit."""
    check_sets(fit, evaluate)
    sets = [FitSet.whole(t) for _, t in fit]
    net_run, runs = counting_run(backend, ns3, progress)
    known = known_burst_of([TraceSetup(t) for _, t in fit], burst_bytes)
    net, _, fcts = fit_network(sets, backend, known, ns3, net_run)
    compute = fit_compute(sets, fcts)
    out = CrossCalibration(backend, net, compute, [name for name, _ in fit], runs=runs[0])
    for name, t in evaluate:  # the fit is done: nothing below changes it
        fs = FitSet.whole(t)
        default_net = NetParams(burst_bytes=int(TraceSetup(t).burst_bytes or known or 0))
        fct0, fct1 = net_run(fs, default_net), net_run(fs, net)
        every = np.ones(len(fs.inp.reqs), dtype=bool)
        t0, p0 = request_errors(fs, ComputeParams(iteration_overhead_s=fs.inp.base.overhead_s), fct0, every)
        t1, p1 = request_errors(fs, compute, fct1, every)
        out.evaluated.append(Evaluated(name, len(fs.flows), len(fs.inp.reqs),
                                       Held(Errors.of(fs.measured, fct0), Errors.of(fs.measured, fct1)),
                                       Held(t0, t1), Held(p0, p1)))
    return out
