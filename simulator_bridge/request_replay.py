"""A measured trace's requests replayed through the serving model: simulated TTFT and TPOT
per request, to put next to the measured ones.

Each request keeps its measured arrival, prompt and output lengths and its P and D
instance. Prefill and decode run on the iteration-time model (the emulated engines'
one) times the trace's compute scale (B/S for a testbed trace). The KV transfer of a
request takes the FCT a network backend gives its flow when the trace's flows are
replayed at their measured start times on their measured spines, so the network runs
once however often the compute constants change (calibration). At TP > 1 a request
has one flow per (P rank, D rank) pair: its KV is on D when the last of them lands,
so the decode waits for the slowest. A fixed
``request_overhead_s`` (proxy, HTTP, the engines' own bookkeeping) is added to the
first token, and ``iteration_wall_s`` to every iteration, unscaled.

The front end, from the client's send to P's server receiving the request (the client,
the proxy and P's HTTP server), is no part of the serving model: where the trace
records P's arrival (``p_arrival_s``) a request reaches P when it did; elsewhere, or
with ``measured_front_end=False``, ``front_end_s`` after its arrival. On the testbed the
front end is this machine's CPU (client and proxy share 2 cores with the engines): 4-14 ms
mean per run on the validation suite, growing with load, which no constant fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec
import numpy as np

from kvpath.bridge.serving_sim import ServingConfig, decode_drain, prefill_drain
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import Trace
from kvpath.trace.header import TraceSetup
from kvpath.workloads import Request


@dataclass(frozen=True)
class ComputeParams:
    """The compute constants calibration fits: a cost per iteration on the trace's own
    clock (``iteration_wall_s``), a speed factor on the model's compute and memory
    rates, and a fixed cost per request. ``iteration_overhead_s`` replaces the
    iteration-time model's own per-iteration overhead (datacenter seconds, scaled by
    the trace's B/S like the rest of the model); None keeps the trace's.

    The two per-iteration costs differ on a slow-motion testbed trace (B/S > 1): its
    emulated engines sleep the model's time, overhead included, times B/S, and then
    run their own loop, which no scale slows. One constant for both fitted on a trace
    at B/S = 1 overshoots one at 2.5 (the validation suite's heavy traces)."""

    iteration_overhead_s: float | None = None
    speed: float = 1.0  # > 1: the engines iterate faster than the model says
    request_overhead_s: float = 0.0
    iteration_wall_s: float = 0.0
    # the front end of a request whose trace does not record it (the fit traces' median)
    front_end_s: float = 0.0

    def __post_init__(self) -> None:
        # request_overhead_s is a fitted median residual: it may be negative
        lows = {"speed": 0.0, "iteration_wall_s": 0.0, "iteration_overhead_s": 0.0, "request_overhead_s": -np.inf,
                "front_end_s": 0.0}
        for name, low in lows.items():
            v = getattr(self, name)
            if v is None and name == "iteration_overhead_s":
                continue
            if (not isinstance(v, (int, float)) or not np.isfinite(v) or v < low
                    or (name == "speed" and v == 0)):
                raise ValueError(f"{name} must be a finite number{'' if low < 0 else ' >= 0'}"
                                 f"{' and > 0' if name == 'speed' else ''}, got {v!r}")

    def model(self, base: IterationTimeModel) -> IterationTimeModel:
        # mfu and mbu cap at 1, so the speed factor scales time directly instead
        if self.iteration_overhead_s is None:
            return base
        return dataclasses.replace(base, overhead_s=self.iteration_overhead_s)


@dataclass
class ReplayInput:
    """What the replay needs from a trace, extracted once."""

    reqs: list[Request]
    p_of: list[int]
    d_of: list[int]
    flows: np.ndarray  # indices into trace.flows, grouped by request in request order
    flow_start: np.ndarray  # per request: where its flows begin in ``flows`` (each has >= 1)
    ttft: np.ndarray  # measured
    tpot: np.ndarray  # measured (NaN for single-token outputs)
    front_end: np.ndarray  # measured: P's arrival - the client's (NaN where not recorded)
    base: IterationTimeModel
    time_scale: float
    # per trace flow: where its replayed FCT starts, from the end of its request's prefill
    # (a layer-wise push began before it, so it is negative; 0 for a whole push)
    kv_offset: np.ndarray | None = None

    @classmethod
    def of(cls, trace: Trace) -> "ReplayInput":
        """A ValueError when the trace has no request to replay, or its header names an
        iteration-time model that cannot be built (``TraceSetup.iteration_time``)."""
        flow_of: dict[str, list[int]] = {}
        for i, f in enumerate(trace.flows):
            flow_of.setdefault(f.request_id, []).append(i)
        rows = [q for q in trace.requests if q.status == "ok" and q.request_id in flow_of
                and q.p_instance and q.d_instance and q.ttft_s is not None]
        if not rows:
            raise ValueError("the trace has no completed request with a KV flow to replay")
        ps = {p: k for k, p in enumerate(sorted({q.p_instance for q in rows}))}
        ds = {d: k for k, d in enumerate(sorted({q.d_instance for q in rows}))}
        setup = TraceSetup(trace)
        groups = [flow_of[q.request_id] for q in rows]
        req = {q.request_id: q for q in rows}
        offset = np.zeros(len(trace.flows))
        if trace.header.meta.get("push_granularity") == "layer":
            for i, f in enumerate(trace.flows):
                q = req.get(f.request_id)
                if q is not None and q.prefill_end_s is not None and f.start_s < q.prefill_end_s:
                    offset[i] = f.start_s - q.prefill_end_s
        return cls(reqs=[Request(q.request_id, q.arrival_s, q.prompt_tokens, max(q.output_tokens, 1)) for q in rows],
                   p_of=[ps[q.p_instance] for q in rows], d_of=[ds[q.d_instance] for q in rows],
                   flows=np.array([i for g in groups for i in g], dtype=np.int64),
                   flow_start=np.cumsum([0] + [len(g) for g in groups[:-1]], dtype=np.int64),
                   ttft=np.array([q.ttft_s for q in rows], dtype=float),
                   tpot=np.array([np.nan if q.tpot_s is None else q.tpot_s for q in rows], dtype=float),
                   front_end=np.array([np.nan if q.p_arrival_s is None else q.p_arrival_s - q.arrival_s
                                       for q in rows], dtype=float),
                   base=setup.iteration_time, time_scale=setup.time_scale, kv_offset=offset)


    def flows_of(self, mask: np.ndarray) -> np.ndarray:
        """The indices into trace.flows of the flows of the requests ``mask`` selects."""
        ends = np.append(self.flow_start[1:], self.flows.size)
        return np.concatenate([self.flows[a:b] for a, b in zip(self.flow_start[mask], ends[mask])]
                              + [np.zeros(0, dtype=np.int64)])

    def kv_time(self, flow_fct: np.ndarray) -> np.ndarray:
        """Per request: from the end of its prefill to its KV on D, when its slowest flow
        lands (a whole push: that flow's FCT; a layer-wise one, which began during the
        prefill: what its last piece adds after the prefill, never below 0)."""
        end = flow_fct if self.kv_offset is None else flow_fct + self.kv_offset
        return np.maximum(np.maximum.reduceat(end[self.flows], self.flow_start), 0.0)


def replay(inp: ReplayInput, flow_fct: np.ndarray, compute: ComputeParams, measured_front_end: bool = True
           ) -> tuple[np.ndarray, np.ndarray]:
    """Simulated (TTFT, TPOT) per request of ``inp``; ``flow_fct``: FCT per trace flow.
    ``measured_front_end``: a request reaches P when the trace says it did (where it
    says); else ``compute.front_end_s`` after its arrival."""
    itm = compute.model(inp.base)
    cfg = ServingConfig(time_scale=inp.time_scale / compute.speed, iteration_wall_s=compute.iteration_wall_s)
    arrival = np.array([r.arrival_s for r in inp.reqs])
    known = np.isfinite(inp.front_end) if measured_front_end else np.zeros(arrival.size, dtype=bool)
    at_p = arrival + np.where(known, np.maximum(np.nan_to_num(inp.front_end), 0.0), compute.front_end_s)
    reqs = [msgspec.structs.replace(r, arrival_s=float(t)) for r, t in zip(inp.reqs, at_p)]
    pre_start, pre_end = prefill_drain(reqs, inp.p_of, max(inp.p_of) + 1, itm, cfg)
    ready = pre_end + inp.kv_time(flow_fct)  # never before the KV has arrived
    _, first, done = decode_drain(reqs, inp.d_of, max(inp.d_of) + 1, ready, itm, cfg)
    out = np.array([r.output_tokens for r in inp.reqs], dtype=float)
    ttft = first - arrival + compute.request_overhead_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (done - first) / (out - 1), np.nan)
    return ttft, tpot
