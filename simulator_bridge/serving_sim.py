"""Two-phase P/D serving simulation (the Vidur x NS-3 method), on the simulated clock.

1. **Prefill drain.** Each P engine runs its queue in continuous-batching iterations
   (whole prompts up to a token budget per iteration), timed by the iteration-time
   model the emulated engines use (``kvpath/iteration_time.py``).
2. **Network.** Every request's KV is one flow from its P host to its D host, leaving
   at prefill end; layer-wise (``push_granularity`` layer), one flow per layer group,
   leaving as the prefill computes the group (``kvpath.layer_push``), on one lane. Its lane (so its spine) is decided by the reservation service's own
   code (``kvpath/reservation/decisions.py``) on the simulated clock: at admission (the request's
   arrival) or at push start, released when the flow's last byte arrives. ``ecmp``
   takes the lane the transfer id hashes to. The network backend computes the FCTs.
3. **Decode drain.** A request reaches its D at prefill end + FCT, never earlier; each D
   runs continuous-batching decode iterations, one token per running request each.

TTFT is first token - arrival (the first token leaves after the first decode
iteration, as in the testbed's traces); TPOT is (completion - first token) / (output
tokens - 1). The result is a kvpath trace, so every exporter and ``compare`` read it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpath.bridge.backends import LaneHooks, backend_type, make
from kvpath.bridge.flow_model import FlowSpec, NetParams, UplinkGate, trivial_fct
from kvpath.bridge.ns3_backend import Ns3Params
from kvpath.deployment import KV_SIDE_CHANNEL_PORT, format_pools
from kvpath.fabric import FabricSpec, check_pools_fit, pd_placement
from kvpath.iteration_time import IterationTimeModel
from kvpath.layer_push import GRANULARITIES, PUSH_ORDERS, piece_starts, variant_label
from kvpath.models import kv_bytes_per_token
from kvpath.oracle import TableOracle
from kvpath.reservation.decisions import LaneInfo, ReservationService, default_lane
from kvpath.reservation.wire import MODES, PLACEMENTS, RESERVE_AT
from kvpath.trace import FiveTuple, FlowRecord, Header, RequestRecord, Trace
from kvpath.trace.header import (META_BACKEND, META_ITERATION_TIME, META_NET, META_POOLS, META_RESERVE_AT,
                                 META_SOURCE)
from kvpath.trace.metrics import TraceMetrics
from kvpath.workloads import Request

__all__ = ["MODES", "SOURCE", "ServingConfig", "placement_of", "prefill_drain", "decode_drain", "simulate", "summarize"]

LANE_PORT0 = 40000  # lane k of a P-D pair has source port LANE_PORT0 + k
ADMISSION = RESERVE_AT[0]  # reserve a lane at the request's arrival (else at push start)
SOURCE = "simulator_bridge"  # meta.source of the traces this writes (the value older traces carry)


@dataclass
class ServingConfig:
    pools: tuple[int, int] = (8, 8)
    mode: str = "ecmp"
    backend: str = "flow"  # a registered network backend (kvpath.bridge.backends.names())
    lanes: int = 4
    reserve_at: str = ADMISSION  # or push
    dc_delay_s: float = 0.0
    cc_metric: str = "flows"
    scale_s: float = 1.0  # KV bytes divided by S (1: the datacenter's)
    time_scale: float = 1.0  # compute times multiplied by this (B/S in the testbed)
    # a cost per iteration on the trace's own clock, not scaled by time_scale: the
    # engine's own loop (an emulated engine sleeps the scaled model, then runs Python)
    iteration_wall_s: float = 0.0
    max_batch_tokens: int = 8192  # prefill tokens per iteration
    max_num_seqs: int = 256  # decode sequences per iteration
    net: NetParams = field(default_factory=NetParams)
    ns3: Ns3Params = field(default_factory=Ns3Params)
    # when a request's KV leaves P (kvpath.layer_push): one flow at the prefill's end, or
    # one flow per group of layer_group layers as the prefill computes them (same lane)
    push_granularity: str = "request"
    layer_group: int = 4
    # who chooses P, D and the lane: "" (round robin, as the proxy's default; the lane by
    # the mode at reserve_at), or a placement of the reservation service
    # (kvpath/reservation/placer.py: joint, network, load) at each request's arrival
    placement: str = ""
    # P's whole pushes at its NIC (the connector's knobs): at most uplink_pushes in flight
    # per P host (0: no cap), the waiting ones in push_order, each waiting at most
    # push_queue_max_wait_s (on this simulation's clock); layer-wise pieces never wait
    uplink_pushes: int = 0
    push_order: str = "fifo"
    push_queue_max_wait_s: float = 0.2

    def validate(self, spec: FabricSpec) -> None:
        check_pools_fit(spec, *self.pools)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        backend_type(self.backend)  # a ValueError naming the registered backends
        if self.reserve_at not in RESERVE_AT:
            raise ValueError(f"reserve_at must be {' or '.join(RESERVE_AT)}, got {self.reserve_at!r}")
        if self.lanes < 1 or self.scale_s <= 0 or self.time_scale <= 0 or self.iteration_wall_s < 0:
            raise ValueError("lanes must be >= 1, scale_s and time_scale > 0, iteration_wall_s >= 0")
        if self.push_granularity not in GRANULARITIES:
            raise ValueError(f"push_granularity must be one of {', '.join(GRANULARITIES)}, got {self.push_granularity!r}")
        if self.layer_group < 1:
            raise ValueError(f"layer_group must be >= 1, got {self.layer_group}")
        if not 0 <= self.uplink_pushes <= 64 or self.push_order not in PUSH_ORDERS \
                or not 0 <= self.push_queue_max_wait_s <= 10:
            raise ValueError(f"uplink_pushes must be in [0, 64], push_order one of {', '.join(PUSH_ORDERS)}, "
                             f"push_queue_max_wait_s in [0, 10]; got {self.uplink_pushes}, {self.push_order!r}, "
                             f"{self.push_queue_max_wait_s}")
        if self.uplink_pushes and not backend_type(self.backend).closed_loop:
            raise ValueError(f"uplink_pushes needs a closed-loop backend (flow), not {self.backend!r}")
        if self.placement not in ("", *PLACEMENTS):
            raise ValueError(f"placement must be one of round_robin, {', '.join(PLACEMENTS)}, got {self.placement!r}")


def placement_of(policy: str) -> str:
    """``ServingConfig.placement`` for a proxy policy: round robin is the simulation's own
    (""), least outstanding the reservation service's ``load`` placement, and joint and
    network place by the same name."""
    return {"round_robin": "", "least_outstanding": "load"}.get(policy, policy)


def prefill_drain(reqs: list[Request], p_of: list[int], n_p: int, itm: IterationTimeModel,
                  cfg: ServingConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per request: prefill start and end on its P engine."""
    start, end = np.zeros(len(reqs)), np.zeros(len(reqs))
    for p in range(n_p):
        queue = deque(sorted((i for i in range(len(reqs)) if p_of[i] == p), key=lambda i: reqs[i].arrival_s))
        now = 0.0
        while queue:
            now = max(now, reqs[queue[0]].arrival_s)
            batch, budget = [], cfg.max_batch_tokens
            while queue and reqs[queue[0]].arrival_s <= now and (not batch or reqs[queue[0]].prompt_tokens <= budget):
                i = queue.popleft()
                batch.append(i)
                budget -= reqs[i].prompt_tokens
            start[batch] = now
            now += itm.prefill_time([reqs[i].prompt_tokens for i in batch]) * cfg.time_scale + cfg.iteration_wall_s
            end[batch] = now
    return start, end


def decode_drain(reqs: list[Request], d_of: list[int], n_d: int, ready: np.ndarray, itm: IterationTimeModel,
                 cfg: ServingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request: decode start, first token and completion on its D engine."""
    n = len(reqs)
    dstart, first, done = np.zeros(n), np.zeros(n), np.zeros(n)
    for d in range(n_d):
        waiting = deque(sorted((i for i in range(n) if d_of[i] == d), key=lambda i: ready[i]))
        running: list[int] = []
        made: dict[int, int] = {}
        now = 0.0
        while waiting or running:
            if not running:
                now = max(now, ready[waiting[0]])
            while waiting and ready[waiting[0]] <= now and len(running) < cfg.max_num_seqs:
                i = waiting.popleft()
                running.append(i)
                made[i] = 0
                dstart[i] = now
            now += (itm.decode_time([reqs[i].prompt_tokens + made[i] for i in running]) * cfg.time_scale
                    + cfg.iteration_wall_s)
            still = []
            for i in running:
                if made[i] == 0:
                    first[i] = now
                made[i] += 1
                if made[i] >= max(reqs[i].output_tokens, 1):
                    done[i] = now
                else:
                    still.append(i)
            running = still
    return dstart, first, done


class _Lanes:
    """Each P-D pair's lanes: lane k has source port LANE_PORT0 + k and crosses spine
    k mod spines (the connector keeps lanes that cover distinct paths)."""

    def __init__(self, spec: FabricSpec, lanes: int):
        self.spec, self.n = spec, lanes
        self.oracle = TableOracle(spec)

    def infos(self, src: str, dst: str) -> list[LaneInfo]:
        out = []
        for k in range(self.n):
            self.oracle.table[(src, dst, LANE_PORT0 + k, KV_SIDE_CHANNEL_PORT)] = k % self.spec.spines
            out.append(LaneInfo(k, LANE_PORT0 + k, KV_SIDE_CHANNEL_PORT))
        return out


def simulate(spec: FabricSpec, reqs: list[Request], cfg: ServingConfig,
             itm: IterationTimeModel) -> tuple[Trace, dict[str, Any]]:
    cfg.validate(spec)
    t_wall = time.perf_counter()
    n_p, n_d = cfg.pools
    p_hosts, d_hosts = pd_placement(spec, n_p, n_d)
    n = len(reqs)
    lanes = _Lanes(spec, cfg.lanes)
    placed: list[int | None] | None = None
    if cfg.placement:  # P, D and lane at each arrival, by the service's placement (simulator_bridge/placement_sim.py)
        from kvpath.bridge.placement_sim import place_requests

        p_of, d_of, placed, _ = place_requests(spec, reqs, cfg, itm, p_hosts, d_hosts, lanes)
    else:
        p_of, d_of = [i % n_p for i in range(n)], [i % n_d for i in range(n)]  # round robin, as the proxy's default
    pre_start, pre_end = prefill_drain(reqs, p_of, n_p, itm, cfg)
    kvb = kv_bytes_per_token(itm.model)
    tids = [f"{r.request_id}" for r in reqs]
    flows = [FlowSpec(p_hosts[p_of[i]], d_hosts[d_of[i]], max(1, round(kvb * reqs[i].prompt_tokens / cfg.scale_s)),
                      float(pre_end[i])) for i in range(n)]
    # the network's flows: each request's push whole, or its layer groups (piece k of
    # request i is pieces[j] with owner[j] == i, in start order)
    pieces, owner = [], []
    for i, f in enumerate(flows):
        for start, b in piece_starts(float(pre_start[i]), float(pre_end[i]), itm.model.layers, f.bytes,
                                     cfg.push_granularity, cfg.layer_group):
            if b > 0:
                pieces.append(dataclasses.replace(f, bytes=b, start_s=start))
                owner.append(i)
    clock = [0.0]
    # the lanes are registered once and never expire: simulated time may run past any TTL
    svc = ReservationService(spec, "ecmp" if cfg.mode == "ecmp" else cfg.mode, oracle=lanes.oracle, lease_s=1e12,
                             dc_delay_s=cfg.dc_delay_s, clock=lambda: clock[0], metric=cfg.cc_metric,
                             lanes_ttl_s=math.inf)
    for p in p_hosts:
        for d in d_hosts:
            svc.register_lanes(p, d, lanes.infos(p, d))
    leases: dict[int, str] = {}
    lane_of: dict[int, int] = {}
    left = np.bincount(owner, minlength=n)  # a request's pieces not yet ended

    def decide(j: int, now: float) -> int | None:
        i = owner[j]
        if i not in lane_of and placed is not None:  # the placement chose (and reserved) it already
            lane_of[i] = placed[i] if placed[i] is not None else default_lane(tids[i], cfg.lanes)
        if i not in lane_of:  # a request's first piece reserves its lane; the others follow it
            clock[0] = now
            r = svc.reserve(flows[i].src, flows[i].dst, flows[i].bytes, transfer_id=tids[i])
            leases[i], lane_of[i] = r.lease_id, r.lane if r.lane is not None else default_lane(tids[i], cfg.lanes)
        return lanes.oracle.table[(spec.canonical(flows[i].src), spec.canonical(flows[i].dst),
                                   LANE_PORT0 + lane_of[i], KV_SIDE_CHANNEL_PORT)]

    def on_end(j: int, now: float) -> None:
        i = owner[j]
        left[i] -= 1
        if left[i] == 0 and i in leases:  # released at the push's end (its last piece)
            clock[0] = now
            svc.release(leases.pop(i))

    decide_at = (np.array([reqs[i].arrival_s for i in owner]) if cfg.reserve_at == ADMISSION
                 else np.array([p.start_s for p in pieces]))
    # the backend decides when the lanes are decided: on its own clock (closed loop), or
    # first, on another's or each flow alone, then its run on them (backends/base.py)
    gate = None
    if cfg.uplink_pushes:  # whole pushes wait for a slot of their P host's uplink; pieces never do
        gate = UplinkGate(np.array([p_of[i] for i in owner]), np.full(len(pieces), cfg.push_granularity == "request"),
                          cfg.uplink_pushes, cfg.push_order, cfg.push_queue_max_wait_s)
    waited = np.zeros(len(pieces))
    net = make(cfg.backend, spec, cfg.net, cfg.ns3).serve(pieces, LaneHooks(decide, decide_at, on_end, gate, waited))
    info = dict(net.info)
    push_start, push_end = np.full(n, np.inf), pre_end.copy()  # D has the KV at its last piece, never before P ends
    for j, i in enumerate(owner):
        # a push starts when it leaves P (after its wait for a slot): its FCT is its time on the wire
        push_start[i] = min(push_start[i], pieces[j].start_s + float(waited[j]))
        push_end[i] = max(push_end[i], pieces[j].start_s + float(net.fct_s[j]))
    fct = push_end - push_start
    ready = push_end
    dstart, first, done = decode_drain(reqs, d_of, n_d, ready, itm, cfg)
    trace = _trace(spec, reqs, cfg, p_hosts, d_hosts, p_of, d_of, pre_start, pre_end, flows, push_start, fct, lane_of,
                   dstart, first, done, itm)
    return trace, {"wall_s": time.perf_counter() - t_wall, **info}


def _trace(spec: FabricSpec, reqs: list[Request], cfg: ServingConfig, p_hosts: list[str], d_hosts: list[str],
           p_of: list[int], d_of: list[int], pre_start: np.ndarray, pre_end: np.ndarray, flows: list[FlowSpec],
           push_start: np.ndarray, fct: np.ndarray, lane_of: dict[int, int], dstart: np.ndarray, first: np.ndarray,
           done: np.ndarray, itm: IterationTimeModel) -> Trace:
    """One flow record per push (a layer-wise push's pieces as one, first start to last end)."""
    header = Header(t0_unix=0.0, mode=cfg.mode, fabric=spec.to_dict(), scale_s=cfg.scale_s,
                    meta={META_SOURCE: SOURCE, META_BACKEND: cfg.backend, META_POOLS: format_pools(*cfg.pools),
                          META_RESERVE_AT: cfg.reserve_at, "dc_delay_s": cfg.dc_delay_s,
                          "push_granularity": cfg.push_granularity, "layer_group": cfg.layer_group,
                          "placement": cfg.placement or "round_robin",
                          META_ITERATION_TIME: itm.to_dict(), META_NET: dataclasses.asdict(cfg.net)})
    requests, flow_recs = [], []
    alone = trivial_fct(spec, [FlowSpec(f.src, f.dst, f.bytes, 0.0, lane_of.get(i, 0) % spec.spines)
                               for i, f in enumerate(flows)], cfg.net)
    for i, r in enumerate(reqs):
        f = flows[i]
        lane = lane_of.get(i, 0)
        ft = FiveTuple(spec.host_ip(f.src), spec.host_ip(f.dst), LANE_PORT0 + lane, KV_SIDE_CHANNEL_PORT)
        spine = f"spine{lane % spec.spines}"
        start = float(push_start[i])
        end = start + float(fct[i])
        out = max(r.output_tokens, 1)
        requests.append(RequestRecord(
            request_id=r.request_id, arrival_s=r.arrival_s, prompt_tokens=r.prompt_tokens, output_tokens=out,
            p_instance=p_hosts[p_of[i]], d_instance=d_hosts[d_of[i]], prefill_start_s=float(pre_start[i]),
            prefill_end_s=float(pre_end[i]), kv_bytes=f.bytes, push_start_s=start, push_end_s=end,
            lane=lane, five_tuple=ft, path_predicted=spine, path_measured=spine, decode_start_s=float(dstart[i]),
            first_token_s=float(first[i]), completion_s=float(done[i]), ttft_s=float(first[i]) - r.arrival_s,
            tpot_s=(float(done[i]) - float(first[i])) / (out - 1) if out > 1 else None))
        flow_recs.append(FlowRecord(flow_id=r.request_id, request_id=r.request_id, five_tuple=ft, bytes=f.bytes,
                                    start_s=start, end_s=end, path=spine, lane=lane, path_predicted=spine,
                                    standalone_fct_s=float(alone[i])))
    return Trace(header, requests, flow_recs)


SUMMARY_METRICS = ("requests", "fct_mean_s", "fct_p99_s", "slowdown_mean", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s")


def summarize(trace: Trace, wall_s: float) -> dict[str, Any]:
    """One simulation's row: mode, backend, SUMMARY_METRICS of ``TraceMetrics`` and the wall time."""
    m = TraceMetrics.of(trace).to_dict()
    label = variant_label(trace.header.mode, trace.header.meta.get("push_granularity", "request"))
    placement = trace.header.meta.get("placement", "round_robin")
    return {"mode": label if placement == "round_robin" else f"{label}/{placement}",
            "backend": trace.header.meta.get(META_BACKEND),
            **{k: m[k] for k in SUMMARY_METRICS}, "wall_s": wall_s}

