"""The serving simulation's placement: each request's P, D and lane chosen at its arrival,
on the simulated clock, by the reservation service's own placement code
(kvpath/reservation/placer.py, policies joint, network and load), from what a proxy
would know then.

What the proxy knows, it counts; so does this pass, with the cost model's predictions
where the proxy would see a leg answer: a request stays in flight at its P until its
predicted prefill end (its prompt tokens queued there until then), at its D until its
predicted completion, and its lane stays reserved until its predicted push end. The
network phase then carries each push on the lane chosen here, and the drains time
everything as for round robin: the simulation measures the choices, it does not trust
the predictions that made them.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from kvpath.iteration_time import IterationTimeModel
from kvpath.models import kv_bytes_per_token
from kvpath.placement import CostModel, EngineState
from kvpath.reservation.decisions import ReservationService
from kvpath.reservation.placer import place
from kvpath.fabric import FabricSpec
from kvpath.workloads import Request

__all__ = ["place_requests"]


class _InFlight:
    """One engine's requests in flight as a proxy counts them: (end, tokens) until their end."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, int]] = []
        self.n = 0
        self.tokens = 0

    def add(self, end: float, tokens: int) -> None:
        heapq.heappush(self.ends, (end, tokens))
        self.n += 1
        self.tokens += tokens

    def at(self, now: float) -> None:
        while self.ends and self.ends[0][0] <= now:
            _, t = heapq.heappop(self.ends)
            self.n -= 1
            self.tokens -= t


def place_requests(spec: FabricSpec, reqs: list[Request], cfg: Any, itm: IterationTimeModel,
                   p_hosts: list[str], d_hosts: list[str], lanes: Any
                   ) -> tuple[list[int], list[int], list[int | None], list[dict]]:
    """Per request (in ``reqs``' order): its P index, D index and lane (None: none known),
    and the decision records (the service's log of each placement). ``cfg``: the
    simulation's ServingConfig; ``lanes``: its lanes (``oracle`` and ``infos(src, dst)``)
    (both of kvpath.bridge.serving_sim, which imports this module)."""
    clock = [0.0]
    svc = ReservationService(spec, cfg.mode, oracle=lanes.oracle, lease_s=1e12, dc_delay_s=cfg.dc_delay_s,
                             clock=lambda: clock[0], metric=cfg.cc_metric, lanes_ttl_s=math.inf)
    for p in p_hosts:
        for d in d_hosts:
            svc.register_lanes(p, d, lanes.infos(p, d))
    cost = CostModel(spec, itm, max_batch_tokens=cfg.max_batch_tokens, time_scale=cfg.time_scale,
                     granularity=cfg.push_granularity, layer_group=cfg.layer_group)
    kvb = kv_bytes_per_token(itm.model)
    p_load = [_InFlight() for _ in p_hosts]
    d_load = [_InFlight() for _ in d_hosts]
    leases: list[tuple[float, str]] = []  # (predicted push end, lease id)
    n = len(reqs)
    p_of, d_of, lane_of = [0] * n, [0] * n, [None] * n
    for k in sorted(range(n), key=lambda i: (reqs[i].arrival_s, i)):
        r = reqs[k]
        now = r.arrival_s
        while leases and leases[0][0] <= now:
            clock[0], lid = heapq.heappop(leases)
            svc.release(lid)
        clock[0] = now
        for x in (*p_load, *d_load):
            x.at(now)
        ps = [EngineState(str(i), h, p_load[i].n, p_load[i].tokens) for i, h in enumerate(p_hosts)]
        ds = [EngineState(str(j), h, d_load[j].n) for j, h in enumerate(d_hosts)]
        nbytes = max(1, round(kvb * r.prompt_tokens / cfg.scale_s))
        pl = place(svc, cost, ps, ds, r.prompt_tokens, nbytes, transfer_id=r.request_id, policy=cfg.placement)
        pred = pl.prediction
        p_end = now + pred.wait_s + pred.prefill_s
        push_end = p_end + pred.push_s
        first = push_end + pred.admit_s
        done = first + max(r.output_tokens - 1, 0) * pred.admit_s  # each later token: about an admission's iteration
        p_load[pl.p].add(p_end, r.prompt_tokens)
        d_load[pl.d].add(done, 0)
        if pl.reservation.lease_id in svc.active:
            heapq.heappush(leases, (push_end, pl.reservation.lease_id))
        p_of[k], d_of[k], lane_of[k] = pl.p, pl.d, pl.reservation.lane
    return p_of, d_of, lane_of, list(svc.decisions)
