"""Replays a reservation service's decision log through the service's own decision code.

A live run's log (``GET /reservation/v1/decisions``) records, for every reservation,
the lanes it chose among with their spines, its bytes, and when (in the service's own
order, ``seq``/``end_seq``) it was made and ended, and each update of its bytes
(``updates``: sequence number, time, bytes, the service's clock). Replaying that sequence through a
fresh :class:`~kvpath.reservation.ReservationService` in some mode answers "what would
this mode have chosen, given exactly the same requests at exactly the same moments":

- replayed in the run's own mode it must reproduce every logged decision (a check
  that the log is complete and the decision code deterministic);
- a ``cc`` run's log replayed as ``dc`` with zero broadcast delay must give the same
  decisions (dc(0) is cc), which a second live run cannot show: its timing differs.

A placement (``POST /v1/place``) is replayed through the placer itself: its record keeps
the engines' states it saw, the policy and guard, and the service's log keeps the changes
of its lane registry (``lanes``, kvpath/reservation/lane_log.py) and the cost model, so the
replay rebuilds the registry as it stood at each decision (from the lane log's
``complete_from_seq`` on) and asks the placer again; the P, D and lane it chooses must
be the logged ones (a placement that found no lane for its pair reserved nothing: its
record has lane null and no lease).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpath.fabric import FabricSpec
from kvpath.oracle import TableOracle
from kvpath.placement import CostModel, EngineState, PlacementError
from kvpath.reservation.decisions import LaneInfo, ReservationService, WorkerPair
from kvpath.reservation.placer import place


class ReplayError(ValueError):
    pass


@dataclass
class ReplayResult:
    mode: str
    dc_delay_s: float
    decisions: int  # reservations replayed (placements among them)
    same_lane: int  # the replay chose the lane the log shows
    differing: list[str]  # transfer ids of the first decisions that differ
    placements: int = 0  # decisions that were placements, decided again
    same_placement: int = 0  # ... whose P, D and lane the replay chose again
    differing_placements: list[str] = field(default_factory=list)
    placements_unverified: int = 0  # made before the lane log's window: their logged lanes replayed

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "dc_delay_s": self.dc_delay_s, "decisions": self.decisions,
                "same_lane": self.same_lane, "differing": self.differing, "placements": self.placements,
                "same_placement": self.same_placement, "differing_placements": self.differing_placements,
                "placements_unverified": self.placements_unverified}


def _spine_index(spine: str | None) -> int | None:
    return None if spine is None else int(spine.removeprefix("spine"))


def replay(decisions: list[dict[str, Any]], spec: FabricSpec, mode: str, dc_delay_s: float = 0.0,
           metric: str = "flows", lanes: list[dict[str, Any]] | None = None,
           cost_model: dict[str, Any] | None = None, lanes_complete_from_seq: int = 0) -> ReplayResult:
    """Run the logged reservations, placements, updates and ends, and the lane registry's
    changes (``lanes``, needed when the log has placements), in the service's order,
    through a new service in ``mode``; count the decisions that chose the logged lane and
    the placements that chose the logged P, D and lane (``cost_model``: the log's). A
    placement made before ``lanes_complete_from_seq`` (the registry's log no longer
    knows the registry then) is not decided again: its logged lane is reserved, so the
    loads stay the log's, and it is counted ``placements_unverified``."""
    if any(d.get("candidates") is None or "seq" not in d for d in decisions):
        raise ReplayError("the log has decisions without candidates or sequence numbers (several worker pairs "
                          "per P-D pair, or a kvpath older than the replayable log)")
    placed = [d for d in decisions if d.get("placement")]
    cost = None
    if placed:
        if lanes is None or cost_model is None:
            raise ReplayError("the log has placements: replaying them needs the lane registry's changes and the "
                              "cost model (GET /v1/decisions gives both as 'lanes' and 'cost_model')")
        if any(d["placement"].get("engines") is None or "prefill_engines" not in d["placement"] for d in placed):
            raise ReplayError("a placement's record has no engine states (over 64 engines, or a kvpath older than "
                              "the replayable placement log)")
        try:
            cost = CostModel.from_dict(spec, cost_model)
        except PlacementError as e:
            raise ReplayError(str(e)) from None
    oracle = TableOracle(spec)
    events: list[tuple[int, str, dict[str, Any], Any]] = []
    # the service's own clock where the log has it (what its dc views aged by), else wall time
    timed = all("t" in d for d in decisions) and all("t" in e for e in lanes or ())
    for ev in lanes or ():
        for lane, sport, dport, _proto, spine in ev.get("lanes") or ():
            oracle.table[(ev["src_host"], ev["dst_host"], sport, dport)] = _spine_index(spine)
        events.append((ev["seq"], "lanes", ev, None))
    for d in decisions:
        for lane, sport, dport, spine in d["candidates"]:
            oracle.table[(d["src_host"], d["dst_host"], sport, dport)] = _spine_index(spine)
        events.append((d["seq"], "place" if d.get("placement") else "reserve", d, None))
        for seq, at, nbytes, *t in d.get("updates", ()):
            events.append((seq, "update", d, (t[0] if t and timed else at, nbytes)))
        if d.get("end_seq") is not None:
            events.append((d["end_seq"], "end", d, None))
    events.sort(key=lambda e: e[0])
    now = [0.0]
    # leases never expire by themselves here, nor lanes: the log says when each ended
    svc = ReservationService(spec, mode, oracle=oracle, lease_s=1e12, dc_delay_s=dc_delay_s,
                             clock=lambda: now[0], metric=metric, lanes_ttl_s=1e12)
    leases: dict[str, str] = {}
    res = ReplayResult(mode, dc_delay_s, len(decisions), 0, [])
    t0 = 0.0 if timed else min((d["at"] for d in decisions), default=0.0)
    for _, kind, d, upd in events:
        if kind == "update":
            at = upd[0]
        elif kind == "end":
            at = d["ended_t"] if timed else d["ended_at"]
        else:
            at = d["t"] if timed else d["at"]
        now[0] = max(now[0], at - t0)
        if kind == "lanes":
            _registry(svc, d)
        elif kind == "end":
            svc.release(leases.pop(d["lease_id"]))
        elif kind == "update":  # its bytes on its links (the lease never expires here)
            svc.update(leases[d["lease_id"]], int(upd[1]))
        elif kind == "place" and d["seq"] > lanes_complete_from_seq:
            _place(svc, cost, d, leases, res)
        elif kind == "place":  # the registry then is not known: the logged lane, not a new decision
            res.placements_unverified += 1
            if d["lane"] is not None:
                lane = next(c for c in d["candidates"] if c[0] == d["lane"])
                r = svc.reserve(d["src_host"], d["dst_host"], d["bytes"], lanes=[LaneInfo(*lane[:3])],
                                transfer_id=d["transfer_id"])
                leases[d["lease_id"]] = r.lease_id
        else:
            lns = [LaneInfo(lane, sport, dport) for lane, sport, dport, _ in d["candidates"]]
            r = svc.reserve(d["src_host"], d["dst_host"], d["bytes"], lanes=lns, transfer_id=d["transfer_id"])
            leases[d["lease_id"]] = r.lease_id
            _count(res, r.lane == d["lane"], d)
    return res


def _count(res: ReplayResult, same: bool, d: dict[str, Any]) -> None:
    if same:
        res.same_lane += 1
    elif len(res.differing) < 20:
        res.differing.append(d["transfer_id"])


def _registry(svc: ReservationService, ev: dict[str, Any]) -> None:
    pair = WorkerPair(**ev["pair"]) if ev.get("pair") else None
    worker = "" if pair is not None else ev["worker"]
    if ev.get("lanes") is None:
        svc.unregister_lanes(ev["src_host"], ev["dst_host"], worker, pair)
    else:
        svc.register_lanes(ev["src_host"], ev["dst_host"],
                           [LaneInfo(lane, sport, dport, proto=proto) for lane, sport, dport, proto, _ in ev["lanes"]],
                           worker, pair)


def _place(svc: ReservationService, cost: CostModel | None, d: dict[str, Any], leases: dict[str, str],
           res: ReplayResult) -> None:
    assert cost is not None
    pl_rec = d["placement"]
    states = [EngineState(*e) for e in pl_rec["engines"]]
    n_p = pl_rec["prefill_engines"]
    ps, ds = states[:n_p], states[n_p:]
    pl = place(svc, cost, ps, ds, pl_rec["prompt_tokens"], d["bytes"], d["transfer_id"], pl_rec["policy"],
               pl_rec["guard"])
    if d["lease_id"]:  # (a placement without a lane has no lease)
        leases[d["lease_id"]] = pl.reservation.lease_id
    _count(res, pl.reservation.lane == d["lane"], d)
    res.placements += 1
    if (ps[pl.p].name, ds[pl.d].name, pl.reservation.lane) == (pl_rec["p"], pl_rec["d"], d["lane"]):
        res.same_placement += 1
    elif len(res.differing_placements) < 20:
        res.differing_placements.append(d["transfer_id"])
