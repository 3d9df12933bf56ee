"""Replays a reservation service's decision log through the service's own decision code.

A live run's log (``GET /reservation/v1/decisions``) records, for every reservation,
the lanes it chose among with their spines, its bytes, and when (in the service's own
order, ``seq``/``end_seq``) it was made and ended, and each update of its bytes
(``updates``: sequence number, time, bytes). Replaying that sequence through a
fresh :class:`~kvpath.reservation.ReservationService` in some mode answers "what would
this mode have chosen, given exactly the same requests at exactly the same moments":

- replayed in the run's own mode it must reproduce every logged decision (a check
  that the log is complete and the decision code deterministic);
- a ``cc`` run's log replayed as ``dc`` with zero broadcast delay must give the same
  decisions (dc(0) is cc), which a second live run cannot show: its timing differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpath.fabric import FabricSpec
from kvpath.oracle import TableOracle
from kvpath.reservation.decisions import LaneInfo, ReservationService


class ReplayError(ValueError):
    pass


@dataclass
class ReplayResult:
    mode: str
    dc_delay_s: float
    decisions: int  # reservations replayed
    same_lane: int  # the replay chose the lane the log shows
    differing: list[str]  # transfer ids of the first decisions that differ

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "dc_delay_s": self.dc_delay_s, "decisions": self.decisions,
                "same_lane": self.same_lane, "differing": self.differing}


def replay(decisions: list[dict[str, Any]], spec: FabricSpec, mode: str, dc_delay_s: float = 0.0,
           metric: str = "flows") -> ReplayResult:
    """Run the logged reservations and their ends, in the service's order, through a new
    service in ``mode``; count the decisions that chose the logged lane."""
    if any(d.get("candidates") is None or "seq" not in d for d in decisions):
        raise ReplayError("the log has decisions without candidates or sequence numbers (several worker pairs "
                          "per P-D pair, or a kvpath older than the replayable log)")
    oracle = TableOracle(spec)
    events: list[tuple[int, str, dict[str, Any], Any]] = []
    for d in decisions:
        for lane, sport, dport, spine in d["candidates"]:
            idx = None if spine is None else int(spine.removeprefix("spine"))
            oracle.table[(d["src_host"], d["dst_host"], sport, dport)] = idx
        events.append((d["seq"], "reserve", d, None))
        for seq, at, nbytes in d.get("updates", ()):
            events.append((seq, "update", d, (at, nbytes)))
        if d.get("end_seq") is not None:
            events.append((d["end_seq"], "end", d, None))
    events.sort(key=lambda e: e[0])
    now = [0.0]
    # leases never expire by themselves here: the log says when each one ended
    svc = ReservationService(spec, mode, oracle=oracle, lease_s=1e12, dc_delay_s=dc_delay_s,
                             clock=lambda: now[0], metric=metric)
    leases: dict[str, str] = {}
    same, differing = 0, []
    t0 = min((d["at"] for d in decisions), default=0.0)
    for _, kind, d, upd in events:
        now[0] = {"reserve": d["at"], "end": d.get("ended_at"), "update": upd and upd[0]}[kind] - t0
        if kind == "end":
            svc.release(leases.pop(d["lease_id"]))
            continue
        if kind == "update":  # its bytes on its links (the lease never expires here)
            svc.update(leases[d["lease_id"]], int(upd[1]))
            continue
        lanes = [LaneInfo(lane, sport, dport) for lane, sport, dport, _ in d["candidates"]]
        r = svc.reserve(d["src_host"], d["dst_host"], d["bytes"], lanes=lanes, transfer_id=d["transfer_id"])
        leases[d["lease_id"]] = r.lease_id
        if r.lane == d["lane"]:
            same += 1
        elif len(differing) < 20:
            differing.append(d["transfer_id"])
    return ReplayResult(mode, dc_delay_s, len(decisions), same, differing)
