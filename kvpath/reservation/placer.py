"""Joint placement: P, D and the lane chosen together, in one decision that reserves.

:func:`place` runs in the reservation service, where the link state is, so the choice
and the lane's reservation are one atomic step (the service is single-threaded):
concurrent admissions never both take the same "free" link. Every candidate (P, D,
lane) is costed by the shared model (:class:`kvpath.placement.CostModel`): P's queue,
the prefill, the push beside the load already reserved on each link of the lane's path,
D's admission. Policies (``kvpath.placement.PLACEMENTS``):

- ``joint``: the least predicted TTFT over every (P, D, lane);
- ``network``: P by least outstanding, then D and the lane by the push and D's
  admission only (D by network cost: NetKV's idea, with the lane);
- ``load``: P and D by least outstanding, the lane by the service's own rule (ecmp, cc
  or dc): the baseline, decided in the same place.

``joint`` and ``network`` choose the lane by its cost whatever the service's mode (a dc
service costs it on what the P host's agent has heard).

A guard keeps every policy off an instance with more than ``guard`` requests above the
least loaded of its pool, so a cheap-looking instance is not piled on while its own
counts catch up. Equal predictions go to the lane whose spine links carry the fewest
reserved flows, then bytes (cc's rule), then the lower P index, D index, lane id; a pair
with no lane known loses every tie: deterministic.

A candidate's push: every link of its paths carries this flow's bytes on it (a transfer
over several worker pairs splits its bytes evenly among them, as the service charges
them; P's uplink and D's downlink carry all of it) beside the load reserved there.

Pruning: pairs are visited in order of a lower bound (P's wait and prefill, D's
admission, and the push on the pair's two host links, which every candidate of the pair
crosses with the whole bytes; 0 within one host); the first pair whose bound is above the
best found ends the search, so a large pool costs a few pairs, not all of them. At most
MAX_PAIRS_VISITED pairs are costed in one decision (the best of them wins).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

from kvpath.placement import PLACEMENTS, CostModel, EngineState, PlacementError, Prediction
from kvpath.reservation.decisions import Reservation, ReservationService, check_bytes
from kvpath.reservation.wire import EngineInfo, FlowScope, PlaceAnswer, PlaceRequest

__all__ = ["GUARD", "MAX_ENGINES", "Placement", "place", "place_request"]

GUARD = 4  # requests above the least loaded of its pool an instance may have and stay a candidate
MAX_ENGINES = 1024  # per pool in one request
MAX_PAIRS = 65536  # P x D candidates in one request: each pair's bound is computed (a caller must not cost seconds)
MAX_PAIRS_VISITED = 1024  # pairs whose lanes are costed in one decision, at most (in order of their bound)
MAX_GUARD = 1024
NO_LANE = 1 << 62  # a pair without a lane loses every tie
LOG_ENGINES = 64  # a decision's record keeps the engines' states (for replay) up to this many in all


@dataclass
class Placement:
    p: int  # index into the P candidates
    d: int  # index into the D candidates
    reservation: Reservation  # its lane and lease (fallback "no_lanes": none known for the pair)
    prediction: Prediction
    considered: int  # (P, D, lane) candidates costed


def _scope(p: EngineState, d: EngineState) -> FlowScope | None:
    if p.engine_id or d.engine_id:
        return FlowScope(p_engine=p.engine_id, d_engine=d.engine_id)
    return None


def _eligible(states: Sequence[EngineState], guard: int) -> list[int]:
    low = min(s.outstanding for s in states)
    return [i for i, s in enumerate(states) if s.outstanding <= low + guard]


def _least_outstanding(states: Sequence[EngineState], eligible: list[int]) -> int:
    return min(eligible, key=lambda i: (states[i].outstanding, i))


def place(svc: ReservationService, cost: CostModel, ps: Sequence[EngineState], ds: Sequence[EngineState],
          prompt_tokens: int, nbytes: int, transfer_id: str = "", policy: str = "joint",
          guard: int = GUARD, exhaustive: bool = False) -> Placement:
    """Choose P, D and the lane for one request and reserve the lane (see the module).
    ``exhaustive``: cost every pair, no pruning (tests and audits: the same choice)."""
    if policy not in PLACEMENTS:
        raise PlacementError(f"policy must be one of {PLACEMENTS}, got {policy!r}")
    if not ps or not ds or len(ps) > MAX_ENGINES or len(ds) > MAX_ENGINES or len(ps) * len(ds) > MAX_PAIRS:
        raise PlacementError(f"prefill and decode: 1 to {MAX_ENGINES} candidates each and at most {MAX_PAIRS} "
                             f"pairs, got {len(ps)} and {len(ds)}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise PlacementError(f"prompt_tokens must be an integer >= 1, got {prompt_tokens!r}")
    check_bytes(nbytes)
    if not 0 <= guard <= MAX_GUARD:
        raise PlacementError(f"guard must be in [0, {MAX_GUARD}], got {guard!r}")
    now = svc.clock()
    svc.expire(now)
    p_hosts = [svc._host(p.host, f"prefill.{i}.host") for i, p in enumerate(ps)]
    d_hosts = [svc._host(d.host, f"decode.{i}.host") for i, d in enumerate(ds)]
    p_ok, d_ok = _eligible(ps, guard), _eligible(ds, guard)
    if policy != "joint":
        p_ok = [_least_outstanding(ps, p_ok)]
    if policy == "load":
        d_ok = [_least_outstanding(ds, d_ok)]
    pre = cost.prefill_s(prompt_tokens)
    wait = {i: cost.wait_s(ps[i]) for i in p_ok}
    by_load: dict[tuple[int, int | None], float] = {}  # D's admission depends on these two only
    admit = {}
    for j in d_ok:
        k = (ds[j].outstanding, ds[j].free_kv_tokens)
        a = by_load.get(k)
        if a is None:
            a = by_load[k] = cost.admit_s(ds[j], prompt_tokens)
        admit[j] = a
    spec = cost.spec
    host_bps, spine_bps = spec.host_link_gbps * 1e9, spec.spine_link_gbps * 1e9
    dc = svc.mode == "dc"  # each P host's agent sees its own view: per-host caches
    views: dict[str, object] = {}
    times: dict[tuple, float] = {}

    def view_of(src: str):
        v = views.get(src)
        if v is None:
            v = views[src] = svc.view(src, now)
        return v

    whole: dict[tuple[str, str], float] = {}  # (not dc) link -> the whole push's time on it

    def link_t(src: str, ln: tuple[str, str], nb: int, rate: float) -> float:
        """The push's time on one link beside its reserved load (cached per decision)."""
        if nb == nbytes and not dc:
            t = whole.get(ln)
            if t is None:
                t = whole[ln] = cost.link_s(rate, nb, *svc.loads.link(ln))
            return t
        k = (src if dc else "", ln, nb)
        t = times.get(k)
        if t is None:
            t = times[k] = cost.link_s(rate, nb, *view_of(src).link(ln))
        return t

    up = {i: _uplink(spec, p_hosts[i]) for i in p_ok}  # P's uplink
    down = {j: _downlink(spec, d_hosts[j]) for j in d_ok}  # D's downlink

    def hosts_t(i: int, j: int) -> float:
        """The push on P's uplink and D's downlink (every path of the pair has both, and
        every worker pair's share crosses them: the whole bytes); 0 within one host."""
        src = p_hosts[i]
        if src == d_hosts[j]:
            return 0.0
        return max(link_t(src, up[i], nbytes, host_bps), link_t(src, down[j], nbytes, host_bps))

    def push_t(src: str, c) -> float:
        """Candidate ``c``'s push on its slowest link (the cost model's shares per link),
        each link's time cached for the decision."""
        return max((link_t(src, ln, b, rate) for ln, b, rate in cost.link_shares(c.paths, nbytes)), default=0.0)

    cores: dict = {}  # a lane's switch-to-switch links -> the whole push's time on the slowest

    def core_t(src: str, c) -> float:
        """One worker pair: the push on the lane's core links (its host links are the
        pair's, :func:`hosts_t`); lanes of many pairs share them, so cached per decision."""
        k = (src, c.core) if dc else c.core
        t = cores.get(k)
        if t is None:
            t = cores[k] = max((link_t(src, ln, nbytes, spine_bps) for ln in c.core), default=0.0)
        return t

    # A bound on each pair (never above any of its candidates): its queue, prefill and
    # admission, and the push on its two host links
    if dc:  # D's downlink as each P host's agent sees it
        pairs = [(wait[i] + admit[j] + cost.after_prefill(hosts_t(i, j), pre), i, j) for i in p_ok for j in d_ok]
    else:
        up_t = [(i, wait[i], p_hosts[i], link_t("", up[i], nbytes, host_bps)) for i in p_ok]
        down_t = [(j, admit[j], d_hosts[j], link_t("", down[j], nbytes, host_bps)) for j in d_ok]
        if cost.granularity == "request":  # (the whole push is after the prefill: no transform)
            pairs = [(w + a + (0.0 if ph == dh else u if u > dt else dt), i, j)
                     for i, w, ph, u in up_t for j, a, dh, dt in down_t]
        else:
            after = cost.after_prefill
            pairs = [(w + a + (0.0 if ph == dh else after(u if u > dt else dt, pre)), i, j)
                     for i, w, ph, u in up_t for j, a, dh, dt in down_t]
    heapq.heapify(pairs)  # visited in order of their bound, as far as needed
    by_request = cost.granularity == "request"
    best: tuple | None = None  # (ttft, i, j, candidate or None, push, cands, its cc key)
    considered = visited = 0
    lease_id = svc.new_lease_id()
    tid = transfer_id or lease_id  # (ecmp's lane hashes it, as reserve does)
    while pairs and (exhaustive or visited < MAX_PAIRS_VISITED):
        bound, i, j = heapq.heappop(pairs)
        if best is not None and bound + pre > best[0] and not exhaustive:
            break  # no later pair can beat it (one that ties is visited: the cc key may decide)
        visited += 1
        src = p_hosts[i]
        cands = svc.candidates(src, d_hosts[j], _scope(ps[i], ds[j]))
        if policy == "load":  # the lane by the service's own rule, the prediction for the log
            cands_costed = [svc.choose(src, cands, tid, now)] if cands else []
        else:
            cands_costed = cands
        if not cands_costed:  # no lane known for the pair: its host links, and it loses ties
            push = cost.after_prefill(hosts_t(i, j), pre)
            ttft = wait[i] + pre + push + admit[j]
            considered += 1
            key = (ttft, NO_LANE, NO_LANE, i, j, -1)
            if best is None or key < (best[0], *best[6], best[1], best[2], _lane(best)):
                best = (ttft, i, j, None, push, cands, (NO_LANE, NO_LANE))
            continue
        ht = hosts_t(i, j)
        wp, a = wait[i] + pre, admit[j]
        for c in cands_costed:
            # one worker pair: its slowest link is a host link or a core link (== push_t's max)
            tt = (ht if ht >= (ct := core_t(src, c)) else ct) if len(c.paths) == 1 else push_t(src, c)
            push = tt if by_request else cost.after_prefill(tt, pre)
            ttft = wp + push + a  # (summed in the order of the bound and of predict())
            considered += 1
            if best is not None and ttft > best[0]:
                continue
            cc = view_of(src).cost(c.core)[:2]  # equal TTFT: the less loaded spine (cc)
            if best is None or (ttft, *cc, i, j, c.lane.lane) < (best[0], *best[6], best[1], best[2], _lane(best)):
                best = (ttft, i, j, c, push, cands, cc)
    assert best is not None
    _, i, j, chosen, push, cands, _ = best
    pred = Prediction(i, j, chosen.lane.lane if chosen is not None else None, wait[i], pre, push, admit[j])
    extra = {"placement": {"policy": policy, "p": ps[i].name, "d": ds[j].name, "prompt_tokens": prompt_tokens,
                           "guard": guard, "predicted": pred.to_dict(), "considered": considered,
                           "prefill_engines": len(ps), "engines": _logged(ps, ds)}}
    if chosen is None:
        r = svc.no_lanes(p_hosts[i], d_hosts[j], nbytes, tid, lease_id, now, extra)
    else:
        r = svc.grant(p_hosts[i], d_hosts[j], nbytes, tid, lease_id, cands, chosen, now, extra)
    svc.counters[f"placements_{policy}"] += 1
    return Placement(i, j, r, pred, considered)


@functools.lru_cache(maxsize=65536)
def _uplink(spec, host: str) -> tuple[str, str]:
    return host, spec.leaf_name(spec.locate(host)[0])


@functools.lru_cache(maxsize=65536)
def _downlink(spec, host: str) -> tuple[str, str]:
    return spec.leaf_name(spec.locate(host)[0]), host


def _state(e: EngineInfo) -> EngineState:
    return EngineState(e.name, e.host, e.outstanding, e.queued_tokens, e.free_kv_tokens, e.engine_id)


def place_request(svc: ReservationService, cost: CostModel, req: PlaceRequest) -> PlaceAnswer:
    """The wire's form of :func:`place` (the service's /v1/place, the proxy's in-process
    reserver): the chosen engines by the request's names."""
    pl = place(svc, cost, [_state(e) for e in req.prefill], [_state(e) for e in req.decode], req.prompt_tokens,
               req.bytes, req.transfer_id, req.policy, req.guard)
    r = pl.reservation
    return PlaceAnswer(prefill=req.prefill[pl.p].name, decode=req.decode[pl.d].name, lease_id=r.lease_id if not
                       r.fallback else "", lane=r.lane, spine=r.path.spine if r.path else None,
                       expires_in_s=r.expires_in(svc.clock()),
                       fallback=r.fallback, predicted=pl.prediction.to_dict(), considered=pl.considered)


def _lane(best: tuple) -> int:
    return best[3].lane.lane if best[3] is not None else -1


def _logged(ps: Sequence[EngineState], ds: Sequence[EngineState]) -> tuple | None:
    """The engines' states as the decision saw them (what a replay needs), or None past
    LOG_ENGINES (the log keeps up to 100,000 decisions)."""
    if len(ps) + len(ds) > LOG_ENGINES or any(len(s.name) > 64 or len(s.engine_id) > 64 for s in (*ps, *ds)):
        return None
    return tuple((s.name, s.host, s.outstanding, s.queued_tokens, s.free_kv_tokens, s.engine_id)
                 for s in (*ps, *ds))

