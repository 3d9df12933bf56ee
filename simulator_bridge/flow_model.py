"""Network backends of the bridge: flows in (source, destination, bytes, start, spine),
completion times out.

- :class:`FlowModel` (``flow``): flow-level max-min fair sharing, event-driven on flow
  arrivals and departures. Links are numbered by rule from the fabric spec (no graph,
  no routing table), a flow's links are four integers, and rates are found by
  progressive filling over numpy arrays, so set-up is arithmetic at any fabric size.
- :func:`trivial_fct` (``trivial``): size over the path's slowest link, alone.

Both take the same two calibration constants: ``overhead_s``, a fixed cost per flow
(posting the transfer, the receiver noticing it), and ``efficiency``, the share of a
link's rate a flow's payload gets (headers, the transport). ``burst_bytes`` lets the
first bytes of a flow through at once, as the testbed's token buckets do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpath.fabric import FabricSpec


@dataclass(frozen=True)
class FlowSpec:
    src: str  # host name or IP of the fabric
    dst: str
    bytes: int
    start_s: float
    spine: int | None = None  # the spine it crosses (None within a leaf)


@dataclass(frozen=True)
class NetParams:
    overhead_s: float = 0.0
    efficiency: float = 1.0
    burst_bytes: int = 0

    def __post_init__(self) -> None:
        if self.overhead_s < 0 or not 0 < self.efficiency <= 1 or self.burst_bytes < 0:
            raise ValueError("overhead_s must be >= 0, efficiency in (0, 1], burst_bytes >= 0")


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

    def links(self, flows: list[FlowSpec]) -> np.ndarray:
        """(n, 4) link ids per flow: host up, leaf->spine, spine->leaf, host down (-1: none)."""
        out = np.full((len(flows), 4), -1, dtype=np.int64)
        s = self.spec.spines
        for i, f in enumerate(flows):
            sl, sh = self.host_index(f.src)
            dl, dh = self.host_index(f.dst)
            if sh == dh:
                continue  # a host to itself: no link
            out[i, 0], out[i, 3] = 2 * sh, 2 * dh + 1
            if sl != dl:
                if f.spine is None or not 0 <= f.spine < s:
                    raise ValueError(f"flow {i} ({f.src} -> {f.dst}) crosses the spines: give its spine in [0, {s})")
                out[i, 1] = 2 * self.hosts + 2 * (sl * s + f.spine)
                out[i, 2] = 2 * self.hosts + 2 * (dl * s + f.spine) + 1
        return out


def max_min_rates(links: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows over links (progressive filling). ``links``: (n, k)
    link ids, -1 for none. A flow with no link gets an infinite rate."""
    n = links.shape[0]
    rate = np.full(n, np.inf)
    if n == 0:
        return rate
    valid = links >= 0
    has = valid.any(axis=1)
    rate[has] = 0.0
    cap = capacity.astype(float).copy()
    active = has.copy()
    while active.any():
        idx = links[active][valid[active]]
        count = np.bincount(idx, minlength=cap.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(count > 0, cap / np.maximum(count, 1), np.inf)
        level = share.min()
        saturated = share <= level * (1 + 1e-12)
        # every active flow grows by the level; those on a saturated link stop there
        act = np.flatnonzero(active)
        rate[act] += level
        cap -= level * count
        on_sat = (saturated[np.where(valid[act], links[act], 0)] & valid[act]).any(axis=1)
        active[act[on_sat]] = False
        cap[saturated] = 0.0
    return rate


class FlowModel:
    """Max-min fair flow-level simulation on a leaf-spine fabric."""

    def __init__(self, spec: FabricSpec, params: NetParams | None = None):
        self.spec = spec
        self.params = params or NetParams()
        self.index = LinkIndex(spec)

    def run(self, flows: list[FlowSpec]) -> np.ndarray:
        """Completion time minus start, per flow, in seconds."""
        n = len(flows)
        if n == 0:
            return np.zeros(0)
        p = self.params
        links = self.index.links(flows)
        cap = self.index.capacity * p.efficiency
        start = np.array([f.start_s for f in flows], dtype=float)
        left = np.array([max(f.bytes - p.burst_bytes, 0) for f in flows], dtype=float)
        end = np.full(n, np.nan)
        order = np.argsort(start, kind="stable")
        nxt = 0  # next arrival in order
        active = np.zeros(n, dtype=bool)
        now = start[order[0]]
        while nxt < n or active.any():
            while nxt < n and start[order[nxt]] <= now:
                i = order[nxt]
                if left[i] <= 0:
                    end[i] = start[i]
                else:
                    active[i] = True
                nxt += 1
            act = np.flatnonzero(active)
            if act.size == 0:
                now = start[order[nxt]]
                continue
            rate = max_min_rates(links[act], cap)
            with np.errstate(divide="ignore"):
                t_done = np.where(np.isinf(rate), 0.0, left[act] / rate)
            dt = t_done.min()
            t_arr = start[order[nxt]] - now if nxt < n else math.inf
            if t_arr < dt:
                dt = t_arr
            left[act] -= np.where(np.isinf(rate), left[act], rate * dt)
            now += dt
            # finished: its bytes ran out in this step (the float remainder is dust)
            done = act[(left[act] <= 1e-3) | (t_done <= dt * (1 + 1e-12))]
            end[done] = now
            active[done] = False
            left[done] = 0.0
        return end - start + p.overhead_s


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
    return out + p.overhead_s
