"""Network backends of the bridge: flows in (source, destination, bytes, start, spine),
completion times out.

- :class:`FlowModel` (``flow``): flow-level max-min fair sharing, event-driven on flow
  arrivals and departures. Links are numbered by rule from the fabric spec (no graph,
  no routing table), a flow's links are four integers, and rates are found by
  progressive filling over numpy arrays, so set-up is arithmetic at any fabric size.
- :func:`trivial_fct` (``trivial``): size over the path's slowest link, alone.

Both take the same two calibration constants: ``overhead_s``, a fixed cost per flow
(posting the transfer, the receiver noticing it), and ``efficiency``, the share of a
link's rate a flow's payload gets (headers, the transport). ``burst_bytes`` is the depth
of the token bucket every directed link has, as the testbed's tbf qdiscs do: in
:class:`FlowModel` a link whose bucket holds tokens passes bytes at ``LINE_X`` times
its rate, the bucket drains by what exceeds the rate and refills at the rate while the
link carries less. So a lone flow gets one burst (it ends at (size - burst) / rate),
while flows that share a link share its one bucket, and a flow that follows another
on a link finds the bucket only as full as the gap between them let it refill.
``trivial`` gives every flow a full bucket (each alone). Flows on one connection
(``FlowSpec.conn``: one lane's TCP stream) share one flow's rate and complete in the
order they started.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvpath.fabric import FabricSpec
from kvpath.layer_push import PUSH_ORDERS

LINE_X = 100.0  # a link's speed while its bucket holds tokens, over its rate (veth: ~line rate)


@dataclass(frozen=True)
class FlowSpec:
    src: str  # host name or IP of the fabric
    dst: str
    bytes: int
    start_s: float
    spine: int | None = None  # the spine it crosses (None within a leaf)
    cold: bool = False  # the first flow on its connection (lane): pays NetParams.cold_s
    # flows with the same conn share one transport connection (a lane's TCP stream):
    # FlowModel gives the connection one flow's share, splits it among the flows with
    # bytes left and completes them in the order they started (None: a connection of its own)
    conn: int | None = None
    # a layer-wise push (kvpath.layer_push): its pieces, (start_s, bytes) each, replayed as
    # flows of their own on its connection (compare.simulate_run); its FCT is their span
    pieces: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class UplinkGate:
    """P's pushes at its sending NIC (the connector's ``uplink_pushes``, ``push_order``
    and ``push_queue_max_wait_s``): at most ``slots`` of the ``gated`` flows in flight per
    ``group`` (a P host's uplink); one that starts with every slot taken waits, and the
    waiting ones take the slots as they free in ``order`` (``fifo``: by start; ``srpt``:
    the fewest bytes first), each at most ``max_wait_s`` (then it goes beyond the cap
    holding no slot, as the connector's bound lets it: the next freed slot goes to a
    waiting one). Flows not ``gated`` (a layer-wise push's pieces)
    never wait and take no slot."""

    group: np.ndarray  # per flow: its uplink (any integer id)
    gated: np.ndarray  # per flow: bool
    slots: int
    order: str = "fifo"
    max_wait_s: float = math.inf

    def __post_init__(self) -> None:
        if self.slots < 1 or self.order not in PUSH_ORDERS or not self.max_wait_s >= 0:
            raise ValueError(f"uplink gate: slots >= 1, order in {PUSH_ORDERS}, max_wait_s >= 0; got {self.slots}, "
                             f"{self.order!r}, {self.max_wait_s}")


@dataclass(frozen=True)
class NetParams:
    # a fixed offset per flow, signed: calibration may find a negative one where the
    # measured links do something faster than the model (a burst ns-3 does not model)
    overhead_s: float = 0.0
    efficiency: float = 1.0
    burst_bytes: int = 0
    # what a lane's first push costs on top (0.5-11 ms on testbed traces; the connection's
    # first transfer: TCP's slow start without a cached ssthresh, UCX's first use)
    cold_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.overhead_s) or not 0 < self.efficiency <= 1 or self.burst_bytes < 0:
            raise ValueError("overhead_s must be finite, efficiency in (0, 1], burst_bytes >= 0")
        if not math.isfinite(self.cold_s) or self.cold_s < 0:
            raise ValueError("cold_s must be finite and >= 0")


def fixed_costs(flows: list[FlowSpec], p: NetParams) -> np.ndarray:
    """What every backend adds to a flow's time on the wire: the per-flow overhead, and
    ``cold_s`` for a lane's first flow."""
    return p.overhead_s + p.cold_s * np.array([f.cold for f in flows], dtype=float)


class LinkIndex:
    """Directed links numbered by rule: host h's uplink and downlink, then leaf l's
    uplink to and downlink from spine s. Capacities in bytes per second."""

    def __init__(self, spec: FabricSpec):
        self.spec = spec
        self.hosts = spec.leaves * spec.hosts_per_leaf
        self.core = spec.leaves * spec.spines
        self.n = 2 * self.hosts + 2 * self.core
        self.capacity = np.empty(self.n)
        self.capacity[: 2 * self.hosts] = spec.host_link_gbps * 1e9 / 8
        self.capacity[2 * self.hosts:] = spec.spine_link_gbps * 1e9 / 8

    def host_index(self, host: str) -> tuple[int, int]:
        leaf, idx = self.spec.locate(host)
        return leaf, leaf * self.spec.hosts_per_leaf + idx

    def flow_links(self, src: str, dst: str, spine: int | None) -> list[int]:
        """A flow's links: host up, leaf->spine, spine->leaf, host down (-1: none)."""
        sl, sh = self.host_index(src)
        dl, dh = self.host_index(dst)
        if sh == dh:
            return [-1, -1, -1, -1]  # a host to itself: no link
        if sl == dl:
            return [2 * sh, -1, -1, 2 * dh + 1]
        s = self.spec.spines
        if spine is None or not 0 <= spine < s:
            raise ValueError(f"a flow {src} -> {dst} crosses the spines: give its spine in [0, {s})")
        return [2 * sh, 2 * self.hosts + 2 * (sl * s + spine), 2 * self.hosts + 2 * (dl * s + spine) + 1, 2 * dh + 1]

    def links(self, flows: list[FlowSpec]) -> np.ndarray:
        """(n, 4) link ids per flow (see :meth:`flow_links`)."""
        out = np.full((len(flows), 4), -1, dtype=np.int64)
        for i, f in enumerate(flows):
            out[i] = self.flow_links(f.src, f.dst, f.spine)
        return out


def max_min_rates(links: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows over links. ``links``: (n, k) link ids, -1 for none.
    A flow with no link gets an infinite rate.

    Progressive filling, several bottlenecks per round: a link whose fair share
    (capacity left / unsettled flows) is no larger than that of any link its flows also
    cross saturates at exactly that share whatever happens elsewhere (the other links'
    shares only grow as flows settle below them), so every such locally-minimal link
    is settled in the same round, not only the global minimum."""
    n = links.shape[0]
    rate = np.full(n, np.inf)
    if n == 0:
        return rate
    valid = links >= 0
    has = valid.any(axis=1)
    rate[has] = 0.0
    # only the links these flows cross: the work per call follows the flows, not the fabric
    used, compact = np.unique(links[valid], return_inverse=True)
    links = np.full(links.shape, -1, dtype=np.int64)
    links[valid] = compact
    safe = np.where(valid, links, 0)  # -1 would index the last link: mask it with inf
    cap = capacity[used].astype(float)
    active = np.flatnonzero(has)
    while active.size:
        lk, ok = safe[active], valid[active]
        count = np.bincount(lk[ok], minlength=cap.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(count > 0, np.maximum(cap, 0.0) / np.maximum(count, 1), np.inf)
        flow_min = np.where(ok, share[lk], np.inf).min(axis=1)
        link_min = np.full(cap.size, np.inf)
        np.minimum.at(link_min, lk[ok], np.broadcast_to(flow_min[:, None], lk.shape)[ok])
        bottleneck = (count > 0) & (share <= link_min * (1 + 1e-12))
        done = (bottleneck[lk] & ok).any(axis=1)
        settled = active[done]
        rate[settled] = flow_min[done]
        w = np.broadcast_to(flow_min[done][:, None], lk[done].shape)[ok[done]]
        cap -= np.bincount(lk[done][ok[done]], weights=w, minlength=cap.size)
        cap[bottleneck] = 0.0
        active = active[~done]
    return rate


class FlowModel:
    """Max-min fair flow-level simulation on a leaf-spine fabric."""

    def __init__(self, spec: FabricSpec, params: NetParams | None = None):
        self.spec = spec
        self.params = params or NetParams()
        self.index = LinkIndex(spec)

    def run(self, flows: list[FlowSpec], decide: Callable[[int, float], int | None] | None = None,
            decide_at: np.ndarray | None = None, on_end: Callable[[int, float], None] | None = None,
            gate: UplinkGate | None = None, waited: np.ndarray | None = None) -> np.ndarray:
        """Completion time minus start, per flow, in seconds.

        With ``decide``, a flow's spine is chosen during the simulation: ``decide(i, now)``
        is called at ``decide_at[i]`` (default: the flow's start; never after it), in
        time order with the other events, and ``on_end(i, now)`` when its last byte
        arrives, so a decision sees exactly the flows that ended before it (a
        reservation service on the simulated clock). With ``gate``, a flow may wait for
        a slot of its uplink (:class:`UplinkGate`): its time waiting is in its completion
        time, and in ``waited`` (filled per flow, when given)."""
        n = len(flows)
        if n == 0:
            return np.zeros(0)
        p = self.params
        cap = self.index.capacity * p.efficiency
        depth = float(p.burst_bytes)
        tokens = np.full(cap.size, depth)  # every bucket full when the trace starts
        start = np.array([f.start_s for f in flows], dtype=float)
        links = np.full((n, 4), -1, dtype=np.int64) if decide else self.index.links(flows)
        at = start if decide_at is None else np.minimum(np.asarray(decide_at, dtype=float), start)
        left = np.array([f.bytes for f in flows], dtype=float)
        end = np.full(n, np.nan)
        # connection ids (a flow without one is alone on its own) and, per connection, the
        # flows that started and are not complete, in the order they started
        conn = np.array([f.conn if f.conn is not None else -1 - i for i, f in enumerate(flows)], dtype=np.int64)
        pending: dict[int, deque[int]] = {}
        drained = np.zeros(n, dtype=bool)  # bytes all delivered, completion waits for an earlier flow
        arrivals, decisions = np.argsort(start, kind="stable"), np.argsort(at, kind="stable")
        ai, di = 0, (0 if decide else n)  # without decide every flow is decided already
        active = np.zeros(n, dtype=bool)
        now = min(start.min(), at.min())
        began = np.zeros(n, dtype=bool)
        holds = np.zeros(n, dtype=bool)  # gate: it took a slot (one that went at its bound holds none)
        in_flight: dict[int, int] = {}  # gate: per uplink, its gated flows in flight
        queued: dict[int, list] = {}  # gate: per uplink, a heap of the flows waiting for a slot
        overdue: list[tuple[float, int]] = []  # gate: (when its wait runs out, flow), lazily cleaned

        def begin(i: int, slot: bool = False) -> None:
            began[i] = True
            if waited is not None:
                waited[i] = now - start[i]
            pending.setdefault(int(conn[i]), deque()).append(i)
            active[i] = True
            if slot:
                holds[i] = True
                g = int(gate.group[i])
                in_flight[g] = in_flight.get(g, 0) + 1
            if left[i] <= 0 or (links[i] < 0).all():
                finish(np.array([i]))

        def arrive(i: int) -> None:
            if gate is None or not gate.gated[i]:
                begin(i)
                return
            g = int(gate.group[i])
            if in_flight.get(g, 0) < gate.slots:
                begin(i, slot=True)
                return
            key = (flows[i].bytes, start[i], i) if gate.order == "srpt" else (start[i], i)
            heapq.heappush(queued.setdefault(g, []), (key, i))
            if math.isfinite(gate.max_wait_s):
                heapq.heappush(overdue, (start[i] + gate.max_wait_s, i))

        def slot_freed(g: int) -> None:
            in_flight[g] -= 1
            q = queued.get(g)
            while q and in_flight[g] < gate.slots:
                _, i = heapq.heappop(q)
                if not began[i]:  # (one that went at its bound is still in the heap)
                    begin(i, slot=True)

        def finish(ids: np.ndarray) -> None:
            """Their bytes are delivered; each completes once every flow that started
            before it on its connection has (a lane's transfers complete in order)."""
            drained[ids] = True
            left[ids] = 0.0
            for c in {int(conn[i]) for i in ids}:
                q = pending[c]
                while q and drained[q[0]]:
                    i = q.popleft()
                    end[i] = now
                    active[i] = False
                    if on_end is not None:
                        on_end(i, now)
                    if holds[i]:  # (as in the connector: one that went at its bound freed no slot)
                        slot_freed(int(gate.group[i]))

        while di < n or ai < n or active.any() or overdue:
            while di < n and at[decisions[di]] <= now:
                i = int(decisions[di])
                assert decide is not None
                links[i] = self.index.flow_links(flows[i].src, flows[i].dst, decide(i, now))
                di += 1
            while overdue and (overdue[0][0] <= now or began[overdue[0][1]]):  # (and the stale ones)
                _, i = heapq.heappop(overdue)
                if not began[i]:  # waited its bound: goes beyond the cap, holding no slot
                    begin(i)
            while ai < n and start[arrivals[ai]] <= now:
                i = int(arrivals[ai])
                ai += 1
                arrive(i)
            t_next = min(at[decisions[di]] - now if di < n else math.inf,
                         start[arrivals[ai]] - now if ai < n else math.inf,
                         overdue[0][0] - now if overdue else math.inf)
            act = np.flatnonzero(active & ~drained)  # the flows with bytes to send
            if act.size == 0:
                if math.isinf(t_next):
                    break
                now += t_next
                tokens = np.minimum(tokens + cap * t_next, depth)  # idle links refill
                continue
            burst = tokens >= 1.0  # a byte's hysteresis: float dust on a saturated link is no burst
            # one max-min share per connection, split evenly among its flows with bytes left
            groups, first, member = np.unique(conn[act], return_index=True, return_inverse=True)
            share = max_min_rates(links[act[first]], np.where(burst, cap * LINE_X, cap))
            rate = share[member] / np.bincount(member, minlength=groups.size)[member]
            lk = links[act]
            ok = lk >= 0
            load = np.bincount(lk[ok], weights=np.broadcast_to(rate[:, None], lk.shape)[ok], minlength=cap.size)
            t_done = left[act] / rate
            # a bucket that drains runs out: the link falls back to its rate then
            draining = burst & (load > cap * (1 + 1e-12))
            with np.errstate(divide="ignore"):
                t_empty = np.where(draining, tokens / np.where(draining, load - cap, 1.0), math.inf).min()
            dt = min(t_done.min(), t_next, t_empty)
            left[act] -= rate * dt
            tokens = np.clip(tokens + (cap - load) * dt, 0.0, depth)
            tokens[draining & (tokens < 1.0)] = 0.0
            now += dt
            # finished: its bytes ran out in this step (the float remainder is dust)
            finish(act[(left[act] <= 1e-3) | (t_done <= dt * (1 + 1e-12))])
        return end - start + fixed_costs(flows, p)


def trivial_fct(spec: FabricSpec, flows: list[FlowSpec], params: NetParams | None = None) -> np.ndarray:
    """Each flow alone: bytes over its path's slowest link (the analytic formula)."""
    p = params or NetParams()
    index = LinkIndex(spec)
    links = index.links(flows)
    out = np.zeros(len(flows))
    for i, f in enumerate(flows):
        ids = links[i][links[i] >= 0]
        if ids.size:
            out[i] = max(f.bytes - p.burst_bytes, 0) / (index.capacity[ids].min() * p.efficiency)
    return out + fixed_costs(flows, p)
