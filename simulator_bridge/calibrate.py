"""Fit the simulator's free constants on part of a measured trace; report the error on
the rest, before and after.

The split is by time: the first ``train_frac`` of the requests by arrival (and their
flows) train, the rest are held out. Every flow is always simulated (flows in both parts
share links), but only the training part's errors steer the fit.

- **Network** (per backend): ``overhead_s``, the fixed cost per flow, and for ``flow``
  and ``trivial`` ``efficiency``, the share of a link's rate a payload gets (ns-3
  models headers itself), and ``burst_bytes`` when the trace header does not record
  the links' token-bucket burst. For each (efficiency, burst) on a grid, one network
  run; the overhead is then the median residual (signed), in closed form. The loss is
  |mean error| + |p99 error| of FCT on the training flows.
- **Compute**: the iteration-time model's per-iteration overhead and a speed factor
  (grid), then the fixed cost per request as the median TTFT residual. The loss is
  |mean TTFT error| + |p99 TTFT error| + |mean TPOT error| on the training requests,
  with the network's FCTs from the fitted network constants.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvpath.trace import Trace
from simulator_bridge.compare import Errors, simulate, trace_fabric, trace_flows
from simulator_bridge.flow_model import NetParams
from simulator_bridge.ns3_backend import Ns3Params
from simulator_bridge.request_replay import ComputeParams, ReplayInput, replay

EFFICIENCY_GRID = tuple(float(x) for x in np.round(np.linspace(0.80, 1.0, 11), 3))
BURST_GRID = (0, 32 << 10, 64 << 10, 128 << 10, 256 << 10)
ITER_OVERHEAD_GRID = (0.0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.008)
SPEED_GRID = (0.8, 0.9, 1.0, 1.1, 1.25)


@dataclass
class Held:
    """Held-out errors of one quantity before and after calibration."""

    before: Errors
    after: Errors


@dataclass
class Calibration:
    backend: str
    net: NetParams
    compute: ComputeParams
    train_requests: int
    held_requests: int
    fct: Held
    ttft: Held
    tpot: Held
    runs: int = 0  # network runs the fit took
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        def held(h: Held) -> dict[str, Any]:
            return {"before": h.before.to_dict(), "after": h.after.to_dict()}

        return {"backend": self.backend, "net": dataclasses.asdict(self.net), "compute": dataclasses.asdict(self.compute),
                "train_requests": self.train_requests, "held_requests": self.held_requests, "network_runs": self.runs,
                "fct": held(self.fct), "ttft": held(self.ttft), "tpot": held(self.tpot)}


def _loss(e: Errors) -> float:
    return abs(e.mean) + abs(e.p99)


def _split(trace: Trace, inp: ReplayInput, train_frac: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training masks over requests and over flows, and the cut time."""
    if not 0 < train_frac < 1:
        raise ValueError(f"train_frac must be in (0, 1), got {train_frac}")
    arrival = np.array([r.arrival_s for r in inp.reqs])
    k = int(round(train_frac * arrival.size))
    if k < 1 or k >= arrival.size:
        raise ValueError(f"{arrival.size} requests cannot be split {train_frac:.0%} / {1 - train_frac:.0%}: "
                         "both parts need at least one")
    cut = np.sort(arrival)[k - 1]
    req_train = arrival <= cut
    flow_train = np.zeros(len(trace.flows), dtype=bool)
    flow_train[inp.flow_index[req_train]] = True
    return req_train, flow_train, cut


def _finite(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ok = mask & np.isfinite(a) & np.isfinite(b) & (a > 0)
    return a[ok], b[ok]


def calibrate(trace: Trace, backend: str, train_frac: float = 0.5, ns3: Ns3Params | None = None,
              progress: Callable[[str], None] | None = None) -> Calibration:
    spec = trace_fabric(trace)
    flows, measured = trace_flows(trace)
    inp = ReplayInput.of(trace)
    req_train, flow_train, _ = _split(trace, inp, train_frac)
    known_burst = trace.header.meta.get("burst_bytes")
    held_f = ~flow_train
    runs = 0

    def net_run(p: NetParams) -> np.ndarray:
        nonlocal runs
        runs += 1
        if progress:
            progress(f"{backend}: network run {runs}")
        return simulate(backend, spec, flows, p, ns3)

    # -- network ---------------------------------------------------------------------
    default_net = NetParams(burst_bytes=int(known_burst or 0) if backend != "ns3" else 0)
    fct0 = net_run(default_net)
    grid = [(1.0, default_net.burst_bytes)]
    if backend != "ns3":
        grid = list(itertools.product(EFFICIENCY_GRID, BURST_GRID if known_burst is None else (int(known_burst),)))
    best: tuple[float, NetParams, np.ndarray] | None = None
    for eff, burst in grid:
        p = dataclasses.replace(default_net, efficiency=eff, burst_bytes=burst)
        sim = fct0 if p == default_net else net_run(p)
        over = float(np.median(measured[flow_train] - sim[flow_train]))
        loss = _loss(Errors.of(measured[flow_train], sim[flow_train] + over))
        if best is None or loss < best[0]:
            best = (loss, dataclasses.replace(p, overhead_s=over), sim + over)
    assert best is not None
    _, net, fct1 = best
    fct = Held(Errors.of(measured[held_f], fct0[held_f]), Errors.of(measured[held_f], fct1[held_f]))

    # -- compute (on the fitted network's FCTs) ----------------------------------------
    def req_errors(c: ComputeParams, fct_s: np.ndarray, mask: np.ndarray) -> tuple[Errors, Errors]:
        ttft, tpot = replay(inp, fct_s, c)
        return (Errors.of(*_finite(inp.ttft, ttft, mask)), Errors.of(*_finite(inp.tpot, tpot, mask)))

    before_c = ComputeParams(iteration_overhead_s=inp.base.overhead_s)
    best_c: tuple[float, ComputeParams] | None = None
    for ov, speed in itertools.product(ITER_OVERHEAD_GRID, SPEED_GRID):
        c = ComputeParams(iteration_overhead_s=ov, speed=speed)
        ttft, tpot = replay(inp, fct1, c)
        resid = (inp.ttft - ttft)[req_train]
        c = dataclasses.replace(c, request_overhead_s=float(np.median(resid)))
        e_ttft, e_tpot = req_errors(c, fct1, req_train)
        loss = _loss(e_ttft) + abs(e_tpot.mean)
        if best_c is None or loss < best_c[0]:
            best_c = (loss, c)
    assert best_c is not None
    compute = best_c[1]
    held_r = ~req_train
    t0, p0 = req_errors(before_c, fct0, held_r)
    t1, p1 = req_errors(compute, fct1, held_r)
    return Calibration(backend, net, compute, int(req_train.sum()), int(held_r.sum()), fct, Held(t0, t1), Held(p0, p1),
                       runs)
