"""Measured against simulated: a trace's KV flows replayed through a network backend on
the trace's own fabric, each flow on the spine it was measured on.

The fabric is the trace header's spec at the rates the run had (``TraceSetup.fabric``:
the testbed's tier rates when they are there), so times compare in the trace's own
clock (testbed time for a testbed trace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpath.bridge.backends import make
from kvpath.bridge.flow_model import FlowSpec, NetParams
from kvpath.bridge.ns3_backend import Ns3Params
from kvpath.fabric import FabricSpec
from kvpath.layer_push import piece_starts
from kvpath.trace import Trace
from kvpath.trace.header import TraceSetup

if TYPE_CHECKING:
    from kvpath.bridge.request_replay import ComputeParams

__all__ = ["Errors", "Replayed", "compare", "compare_fct", "compare_replays", "header_net_params",
           "connections", "first_on_connection", "replay_trace", "simulate", "simulate_run", "trace_flows"]


def header_net_params(setup: TraceSetup) -> NetParams:
    """The network constants the trace's run had: the serving simulation's own
    (``meta.net``) when there, else the testbed links' token-bucket burst (or 0)."""
    net = setup.net
    if net is None:
        return NetParams(burst_bytes=setup.burst_bytes or 0)  # a ValueError naming the field if malformed
    try:
        return NetParams(**net)
    except (TypeError, ValueError) as e:  # meta is free-form: a wrong type is the trace's error, not ours
        raise ValueError(f"header meta.net: {e}") from None


def trace_flows(trace: Trace) -> tuple[list[FlowSpec], np.ndarray]:
    """The trace's flows as backend input, and their measured FCTs. A flow that crossed
    the spines but has no measured path cannot be replayed on its path: it is an error."""
    flows, fct = [], []
    # a testbed run's lanes are TCP connections that its pushes share; the serving
    # simulation ran every flow on its own, so its traces replay that way
    lanes = connections(trace)
    conns: list[int | None] = list(lanes) if TraceSetup(trace).is_testbed else [None] * len(trace.flows)
    pieces = layer_pieces(trace)
    for f, cold, conn, parts in zip(trace.flows, _firsts(trace, lanes), conns, pieces):
        spine = None if f.path is None else int(f.path.removeprefix("spine"))
        flows.append(FlowSpec(f.five_tuple.src_ip, f.five_tuple.dst_ip, f.bytes, f.start_s, spine, cold, conn, parts))
        fct.append(f.fct_s)
    return flows, np.array(fct, dtype=float)


def layer_pieces(trace: Trace) -> list[tuple[tuple[float, int], ...]]:
    """Per flow of a layer-wise run (header ``push_granularity`` layer): the pieces its push
    left P in, by the shared model (``kvpath.layer_push.piece_starts``: each layer group
    when its share of the request's measured prefill has passed, never before the flow's
    first WRITE); () for a flow that went whole (it started after P's prefill ended) and
    for every flow of another run."""
    meta = trace.header.meta
    if meta.get("push_granularity") != "layer":
        return [()] * len(trace.flows)
    layers = TraceSetup(trace).iteration_time.model.layers
    group = int(meta.get("layer_group") or 1)
    req = {r.request_id: r for r in trace.requests}
    out: list[tuple[tuple[float, int], ...]] = []
    for f in trace.flows:
        r = req.get(f.request_id)
        if r is None or r.prefill_start_s is None or r.prefill_end_s is None or f.start_s >= r.prefill_end_s:
            out.append(())
            continue
        out.append(tuple((max(t, f.start_s), b) for t, b in
                         piece_starts(r.prefill_start_s, r.prefill_end_s, layers, f.bytes, "layer", group) if b > 0))
    return out


def connections(trace: Trace) -> list[int]:
    """Per flow: a number for its five-tuple (its lane's TCP connection), the same for
    every flow of that connection (``FlowSpec.conn``)."""
    ids: dict[tuple, int] = {}
    return [ids.setdefault((f.five_tuple.src_ip, f.five_tuple.src_port, f.five_tuple.dst_ip, f.five_tuple.dst_port,
                            f.five_tuple.proto), len(ids)) for f in trace.flows]


def first_on_connection(trace: Trace) -> list[bool]:
    """Per flow: is it the first, by start time, on its five-tuple (its lane's TCP
    connection) in this trace? Such a flow pays ``NetParams.cold_s``."""
    return _firsts(trace, connections(trace))


def _firsts(trace: Trace, conns: list[int]) -> list[bool]:
    seen: set[int] = set()
    cold = [False] * len(trace.flows)
    for i in sorted(range(len(trace.flows)), key=lambda k: trace.flows[k].start_s):
        if conns[i] not in seen:
            seen.add(conns[i])
            cold[i] = True
    return cold


def simulate(backend: str, spec: FabricSpec, flows: list[FlowSpec], params: NetParams,
             ns3: Ns3Params | None = None) -> np.ndarray:
    return simulate_run(backend, spec, flows, params, ns3)[0]


def simulate_run(backend: str, spec: FabricSpec, flows: list[FlowSpec], params: NetParams,
                 ns3: Ns3Params | None = None) -> tuple[np.ndarray, int | None, dict[str, int] | None]:
    """(FCT per flow, packets dropped, dropped per tier of port): drops only from a
    packet-level backend (``counts_drops``: ns3), None from the others, which model no queue."""
    if not any(f.pieces for f in flows):
        res = make(backend, spec, params, ns3).replay(flows)
        return res.fct_s, res.drops, res.tier_drops
    # a layer-wise push's pieces are flows of their own (same path, same connection); the
    # push's FCT is from its first piece's start to its last piece's end
    owner, expanded = [], []
    for i, f in enumerate(flows):
        for k, (start, b) in enumerate(f.pieces or ((f.start_s, f.bytes),)):
            expanded.append(dataclasses.replace(f, bytes=b, start_s=start, pieces=(), cold=f.cold and k == 0))
            owner.append(i)
    res = make(backend, spec, params, ns3).replay(expanded)
    end = np.full(len(flows), -np.inf)
    start = np.array([f.start_s for f in flows], dtype=float)
    for j, i in enumerate(owner):
        end[i] = max(end[i], expanded[j].start_s + float(res.fct_s[j]))
    return end - start, res.drops, res.tier_drops


@dataclass
class Errors:
    """Simulated against measured: the relative error of the mean, p50 and p99, and the
    per-flow signed bias (median of (sim - meas) / meas) and mean absolute error."""

    n: int
    mean: float
    p50: float
    p99: float
    bias: float
    mean_abs: float

    @classmethod
    def of(cls, measured: np.ndarray, simulated: np.ndarray) -> "Errors":
        rel = (simulated - measured) / measured

        def err(q: float | None) -> float:
            if q is None:
                return float(simulated.mean() / measured.mean() - 1)
            return float(np.percentile(simulated, q) / np.percentile(measured, q) - 1)

        return cls(int(measured.size), err(None), err(50), err(99), float(np.median(rel)), float(np.abs(rel).mean()))

    @classmethod
    def of_finite(cls, measured: np.ndarray, simulated: np.ndarray) -> "Errors | None":
        """``of`` over the pairs where both are finite; None where nothing is left or the
        measured mean or p99 is not positive (nothing to divide by)."""
        ok = np.isfinite(measured) & np.isfinite(simulated)
        measured, simulated = measured[ok], simulated[ok]
        if not measured.size or not (measured.mean() > 0 and np.percentile(measured, 99) > 0):
            return None
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero item: its own bias is inf
            return cls.of(measured, simulated)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compare_fct(trace: Trace, backends: list[str], params: NetParams,
                ns3: Ns3Params | None = None) -> dict[str, Errors]:
    return {b: e["fct"] for b, e in compare(trace, backends, params, ns3).items()}  # type: ignore[misc]


@dataclass
class Replayed:
    """A trace replayed through one backend: measured and simulated values side by side.
    ``ttft``/``tpot`` pairs are None for a trace without completed requests with a flow."""

    backend: str
    fct: tuple[np.ndarray, np.ndarray]  # (measured, simulated), per flow
    ttft: tuple[np.ndarray, np.ndarray] | None  # per replayed request
    tpot: tuple[np.ndarray, np.ndarray] | None  # requests with two or more output tokens
    drops: int | None = None  # packets the backend dropped (ns3); None: it models no queue
    tier_drops: dict[str, int] | None = None  # the same per tier of port (kvpath.fabric.PORT_TIERS)

    def errors(self) -> dict[str, Errors | None]:
        return {k: None if v is None else Errors.of(*v)
                for k, v in (("fct", self.fct), ("ttft", self.ttft), ("tpot", self.tpot))}


def replay_trace(trace: Trace, backend: str, params: NetParams, ns3: Ns3Params | None = None,
                 compute: ComputeParams | None = None) -> Replayed:
    """The trace's flows through ``backend`` on its own fabric, and its requests through the
    request replay (``request_replay.py``) with ``compute`` (default: the trace's own
    iteration overhead)."""
    from kvpath.bridge.request_replay import ComputeParams, ReplayInput, replay

    if not trace.flows:
        raise ValueError("the trace has no flows to replay (a pull-connector run records none)")
    flows, measured = trace_flows(trace)
    fct, drops, tiers = simulate_run(backend, TraceSetup(trace).fabric, flows, params, ns3)
    try:
        inp = ReplayInput.of(trace)
    except ValueError:
        return Replayed(backend, (measured, fct), None, None, drops, tiers)
    ttft, tpot = replay(inp, fct, compute or ComputeParams())
    ok = np.isfinite(inp.tpot) & np.isfinite(tpot) & (inp.tpot > 0)
    return Replayed(backend, (measured, fct), (inp.ttft, ttft), (inp.tpot[ok], tpot[ok]) if ok.any() else None,
                    drops, tiers)


def compare(trace: Trace, backends: list[str], params: NetParams,
            ns3: Ns3Params | None = None) -> dict[str, dict[str, Errors | None]]:
    """Per backend: FCT errors per flow, and TTFT and TPOT errors per request (None when
    the trace has no completed request with a flow: a flows-only trace) from the
    request replay (``request_replay.py``) with the default compute constants."""
    return {b: r.errors() for b, r in compare_replays(trace, backends, params, ns3).items()}


def compare_replays(trace: Trace, backends: list[str], params: NetParams,
                    ns3: Ns3Params | None = None) -> dict[str, Replayed]:
    """Per backend, the trace replayed (``replay_trace``): errors and drops."""
    return {b: replay_trace(trace, b, params, ns3) for b in backends}
