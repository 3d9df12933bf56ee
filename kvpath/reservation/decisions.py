"""Path reservation: which lane (so which path) a KV flow takes. In-process core.

Modes:
- ``ecmp``: the lane the transfer id hashes to (what the connector does alone);
  no control, reservations are only recorded.
- ``cc``: central Global-First-Fit (after Hedera): among the P host's lanes to
  the D host, take the path whose busiest switch-to-switch link carries the
  fewest reserved flows, then the fewest reserved bytes on those links; ties go
  to the lowest lane id.
- ``dc``: one agent per P host decides with the same rule from its own view; its
  own reservations enter its view at once, other hosts' after ``dc_delay_s``
  (their broadcast delay). Zero delay reproduces ``cc``; a long delay leaves
  each agent blind to the others, drifting toward ``ecmp``-like collisions.

Lanes are registered per (P worker, D worker) pair of a host pair
(kvpath/reservation/lane_registry.py, the service's registry). A transfer is one flow per worker pair that
carries it (each TP rank pushes its shard on its own lane *i*): a reservation's
``scope`` names those pairs (the two engines, or one rank pair), and lane *i* loads
the paths of lane *i* of those pairs only, the bytes split evenly among them. An
unscoped reservation is carried by every registered pair of the host pair.

Leases end a reservation when its release never comes. Loads are integer flow
counts and byte sums per directed link, so they return exactly to zero.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from kvpath.fabric import FabricSpec, Path
from kvpath.oracle import ModelOracle, PathOracle
from kvpath.reservation.lane_registry import (_UNSCOPED, LaneRegistry, ReservationError, UnregisteredLanes,
                                              _Candidate, _Cands)
from kvpath.reservation.link_loads import DelayedView, LinkLoads, LoadEvent, Unheard
from kvpath.reservation.wire import (MAX_EXPECTED_END_S, MAX_TRANSFER_BYTES, METRICS, MODES, FlowScope, LaneInfo,
                                    ReserveAnswer, WorkerPair)

__all__ = ["MODES", "METRICS", "FlowScope", "LaneInfo", "Reservation", "ReservationError", "ReservationService",
           "UnregisteredLanes", "WorkerPair", "default_lane"]

MAX_UPDATES_PER_LEASE = 16  # a lease's updates, each kept in its decision record for replay
LEASE_EXTENSION_MAX = 10  # an update holds a lease at most this many lease times ahead


def default_lane(transfer_id: str, n_lanes: int) -> int:
    """The lane a transfer takes when nobody chose one (stable across processes): the
    connector's rule, which ``ecmp`` mode reproduces."""
    return zlib.crc32(transfer_id.encode()) % n_lanes


def _least_flows(cands: Sequence[_Candidate], flows: Callable, nbytes: Callable) -> _Candidate:
    """cc's key (flows on the busiest core link, bytes over the core links, lane id) at
    its least, over the true loads: :meth:`LinkLoads.cost` without a call per candidate."""
    best = None
    bw = bt = bl = 0
    for c in cands:
        worst = total = 0
        for ln in c.core:
            f = flows(ln, 0)
            if f > worst:
                worst = f
            total += nbytes(ln, 0)
        lane = c.lane.lane
        if best is None or worst < bw or (worst == bw and (total < bt or (total == bt and lane < bl))):
            best, bw, bt, bl = c, worst, total, lane
    assert best is not None
    return best


@dataclass
class Reservation:
    lease_id: str
    transfer_id: str
    src_host: str
    dst_host: str
    bytes: int
    lane: int | None
    src_port: int | None
    path: Path | None
    expires_at: float
    mode: str
    fallback: str = ""  # why no decision was made ("no_lanes"), else ""
    # the chosen lane's path for every worker pair that carries the transfer (``path``
    # is the first), and those pairs' names
    paths: tuple[Path, ...] = ()
    workers: tuple[str, ...] = ()

    def expires_in(self, now: float) -> float | None:
        """Seconds left of its lease at ``now`` (the service's clock); None without a lease."""
        return round(self.expires_at - now, 3) if self.expires_at else None

    def answer(self, now: float) -> ReserveAnswer:
        """The wire's answer; ``now`` on the service's clock (the lease's expiry is on it too)."""
        return ReserveAnswer(
            lease_id=self.lease_id, transfer_id=self.transfer_id, src_host=self.src_host,
            dst_host=self.dst_host, bytes=self.bytes, lane=self.lane, src_port=self.src_port,
            path=list(self.path.nodes) if self.path else None, spine=self.path.spine if self.path else None,
            spines=[p.spine for p in self.paths], workers=list(self.workers),
            expires_in_s=self.expires_in(now),
            mode=self.mode, fallback=self.fallback,
        )


@runtime_checkable
class SyncReserver(Protocol):
    """The in-process service's shape: decides at once (:class:`ReservationService`). Its
    ``reserve`` has the signature of the wire's reservers (``kvpath.reservation.wire``)."""

    def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                transfer_id: str = "", scope: FlowScope | None = None) -> Reservation: ...

    def release(self, lease_id: str) -> bool: ...

    def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> "Reservation | None": ...


def check_bytes(nbytes: object) -> None:
    """One flow's bytes, as every call that takes them checks them."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_TRANSFER_BYTES:
        raise ReservationError(f"bytes must be an integer in [0, {MAX_TRANSFER_BYTES}] (1 TiB), got {nbytes!r}")


class ReservationService(LaneRegistry):
    """The decisions, in process (the :class:`SyncReserver`
    shape). Not thread-safe: the HTTP service calls it from one event loop."""

    def __init__(
        self,
        spec: FabricSpec,
        mode: str = "cc",
        oracle: PathOracle | None = None,
        lease_s: float = 10.0,
        dc_delay_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        metric: str = "flows",
        lanes_ttl_s: float = 900.0,
    ):
        if mode not in MODES:
            raise ReservationError(f"mode must be one of {MODES}, got {mode!r}")
        if metric not in METRICS:
            raise ReservationError(f"metric must be one of {METRICS}, got {metric!r}")
        # cc/dc's load measure: "flows" on the busiest link of a path (then bytes over
        # the path), or "bytes" reserved on its busiest link (Hedera's Global-First-Fit
        # counts demand against capacity; every link here has one capacity)
        self.metric = metric
        if lease_s <= 0 or dc_delay_s < 0:
            raise ReservationError("lease_s must be > 0 and dc_delay_s >= 0")
        self.spec = spec
        self.mode = mode
        self.oracle = oracle or ModelOracle(spec)
        self.lease_s = lease_s
        self.dc_delay_s = dc_delay_s
        self.clock = clock
        self.loads = LinkLoads()  # the global truth (what cc decides on)
        self.active: dict[str, Reservation] = {}
        self._expiry: list[tuple[float, str]] = []
        self._ids = itertools.count(1)
        self._rand, self._rand_at = "", 0  # new_lease_id's batch of random hex digits
        self._unheard = Unheard()  # dc: changes younger than the broadcast delay
        self.counters: dict[str, int] = defaultdict(int)
        # the last decisions (transfer id, lane, spine...), for the testbed's trace
        self.decisions: deque[dict] = deque(maxlen=100_000)
        # one sequence over reservations and their ends, so the decision log replays
        # in the order the service saw it (kvpath/reservation/replay.py)
        self._seq = itertools.count(1)
        self._open_decisions: dict[str, dict] = {}  # lease id -> its decision record, while active
        self._init_registry(lanes_ttl_s)  # (kvpath/reservation/lane_registry.py)

    # ---- decisions -------------------------------------------------------
    def reserve(
        self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None, transfer_id: str = "",
        scope: FlowScope | None = None,
    ) -> Reservation:
        now = self.clock()
        self.expire(now)
        src, dst = self._host(src_host, "src_host"), self._host(dst_host, "dst_host")
        check_bytes(nbytes)
        if scope is not None and not isinstance(scope, FlowScope):
            raise ReservationError(f"scope must be a FlowScope, got {type(scope).__name__}")
        scope = scope or _UNSCOPED
        lease_id = self.new_lease_id()
        tid = transfer_id or lease_id
        cands = self._candidates(src, dst, lanes, scope)
        if not cands:  # no pair registered in scope, or pairs with no lane id in common
            return self.no_lanes(src, dst, nbytes, tid, lease_id, now)
        return self.grant(src, dst, nbytes, tid, lease_id, cands, self.choose(src, cands, tid, now), now)

    def choose(self, src: str, cands: Sequence[_Candidate], tid: str, now: float) -> _Candidate:
        """The lane this mode takes among ``cands`` (not empty) for transfer ``tid`` from P host ``src``."""
        if self.mode == "ecmp":
            # exactly the lane the connector takes by itself (crc32 of the transfer id)
            want = default_lane(tid, max(c.lane.lane for c in cands) + 1)
            return next((c for c in cands if c.lane.lane == want), cands[0])
        return self._least_loaded(cands, self.view(src, now))

    def new_lease_id(self) -> str:
        # a sequence number for logs, and a random part so that one client cannot end
        # another's reservations by guessing their ids (every client holds the one token);
        # the random part is cut from a batch drawn from the OS (one call per 1,024 ids)
        k = self._rand_at
        if k >= len(self._rand):
            self._rand, k = secrets.token_hex(12 * 1024), 0
        self._rand_at = k + 24  # 96 bits: /v1/releases tries 1,024 ids a call
        return f"r{next(self._ids)}-{self._rand[k:k + 24]}"

    def view(self, src: str, now: float) -> "LinkLoads | DelayedView":
        """The loads a decision for P host ``src`` sees: the truth (cc, ecmp), or what
        ``src``'s agent has heard (dc)."""
        return self._view(src, now) if self.mode == "dc" else self.loads

    def grant(self, src: str, dst: str, nbytes: int, tid: str, lease_id: str, cands: Sequence[_Candidate],
              chosen: _Candidate, now: float, extra: dict | None = None) -> Reservation:
        """Reserve ``chosen`` (one of ``cands``, the lanes of the pair it chose among) for
        a flow of ``nbytes``: its load on its links, its lease, its decision record
        (with ``extra`` fields: a placement's inputs and predictions)."""
        lane, paths = chosen.lane, chosen.paths
        r = Reservation(lease_id, tid, src, dst, nbytes, lane.lane, lane.src_port, paths[0], now + self.lease_s,
                        self.mode, paths=paths, workers=chosen.workers)
        self._apply(r, +1, now)
        self.active[lease_id] = r
        heapq.heappush(self._expiry, (r.expires_at, lease_id))
        self.counters["reservations"] += 1
        self._open_decisions[lease_id] = self._log({
            "transfer_id": tid, "lease_id": lease_id, "src_host": src, "dst_host": dst, "bytes": nbytes,
            "lane": r.lane, "src_port": r.src_port, "spine": r.path.spine, "spines": chosen.spines,
            "workers": chosen.workers,
            # what it chose among (the first worker pair's lanes): enough to replay it.
            # Tuples, not lists: the log keeps up to 100,000 records and the garbage
            # collector stops tracking tuples of scalars, but rescans lists on every pass.
            "candidates": cands.log_form() if isinstance(cands, _Cands) else _Cands(cands).log_form()}, now, extra)
        return r

    def no_lanes(self, src: str, dst: str, nbytes: int, tid: str, lease_id: str, now: float,
                 extra: dict | None = None) -> Reservation:
        """No lane known for the pair (none registered in scope, or none in common): nothing
        reserved, the caller goes on the hash's lane. A placement's (``extra``: its record)
        is logged all the same: its P and D are still a choice to replay."""
        self.counters["fallback_no_lanes"] += 1
        if extra is not None:
            self._log({"transfer_id": tid, "lease_id": "", "src_host": src, "dst_host": dst, "bytes": nbytes,
                       "lane": None, "src_port": None, "spine": None, "spines": (), "workers": (), "candidates": (),
                       "fallback": "no_lanes"}, now, extra)
        return Reservation(lease_id, tid, src, dst, nbytes, None, None, None, 0.0, self.mode, "no_lanes")

    def _log(self, decision: dict, now: float, extra: dict | None) -> dict:
        """``decision`` in the log: when (wall clock, and the service's own for replay), in
        which mode, its place in the one sequence of decisions and ends, and ``extra``."""
        decision["at"], decision["t"], decision["mode"], decision["seq"] = time.time(), now, self.mode, next(self._seq)
        if extra:
            decision.update(extra)
        self.decisions.append(decision)
        return decision

    def _ended(self, lease_id: str, how: str, now: float) -> None:
        d = self._open_decisions.pop(lease_id, None)
        if d is not None:
            d.update(ended_at=time.time(), ended_t=now, end=how, end_seq=next(self._seq))

    def release(self, lease_id: str) -> bool:
        """End a reservation; False when it already ended (idempotent)."""
        r = self.active.pop(lease_id, None)
        if r is None:
            self.counters["releases_unknown"] += 1
            return False
        now = self.clock()
        self._apply(r, -1, now)
        self._ended(lease_id, "released", now)
        self.counters["releases"] += 1
        return True

    def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> Reservation | None:
        """A live reservation's flow, better known: its whole ``nbytes`` replace the
        reserved bytes on its links (its flow count stays), and with ``expected_end_s``
        (seconds from now) the lease lasts ``lease_s`` past that (at most
        ``LEASE_EXTENSION_MAX`` lease times from now). None when the lease had
        already ended. A layer-wise push reserves at its first layer with the blocks that
        exist then, and learns its bytes when its request's prompt is computed."""
        now = self.clock()
        self.expire(now)
        check_bytes(nbytes)
        if expected_end_s is not None and not 0 <= expected_end_s <= MAX_EXPECTED_END_S:
            raise ReservationError(f"expected_end_s must be in [0, {MAX_EXPECTED_END_S:g}], got {expected_end_s!r}")
        r = self.active.get(lease_id)
        if r is None:
            self.counters["updates_unknown"] += 1
            return None
        d = self._open_decisions.get(lease_id)
        if d is not None and len(d.get("updates", ())) >= MAX_UPDATES_PER_LEASE:
            raise ReservationError(f"lease {lease_id} was updated {MAX_UPDATES_PER_LEASE} times already")
        if nbytes != r.bytes:
            self._apply(r, -1, now)
            r.bytes = nbytes
            self._apply(r, +1, now)
        if expected_end_s is not None:  # (bounded: a token holder must not pin a lease for an hour)
            r.expires_at = now + min(expected_end_s + self.lease_s, LEASE_EXTENSION_MAX * self.lease_s)
            heapq.heappush(self._expiry, (r.expires_at, lease_id))  # the old entry is skipped when due
        if d is not None:  # replayed in order with the reservations and their ends
            d["updates"] = (*d.get("updates", ()), (next(self._seq), time.time(), nbytes, now))
        self.counters["updates"] += 1
        return r

    def expire(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        self._sweep_lanes(now)
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lid = heapq.heappop(self._expiry)
            r = self.active.get(lid)
            if r is not None and r.expires_at <= now:  # (an updated lease's older entry: not yet)
                del self.active[lid]
                self._apply(r, -1, now)
                self._ended(lid, "expired", now)
                self.counters["leases_expired"] += 1
                n += 1
        return n

    def state(self) -> dict:
        self.expire()
        return {
            "mode": self.mode,
            "active": len(self.active),
            "reserved_flows": self.loads.total_flows(),
            "links": {f"{a}->{b}": {"flows": f, "bytes": self.loads.bytes.get((a, b), 0)}
                      for (a, b), f in sorted(self.loads.flows.items())},
            "lanes_known": {f"{s}->{d}": {w: [[l.lane, l.src_port, l.dst_port] for l in reg.lanes]
                                          for w, reg in ws.items()}
                            for (s, d), ws in self._lanes.items()},
            "worker_pairs": self._n_pairs,
            "lanes_registered": self._n_lanes,
            "counters": dict(self.counters),
        }

    # ---- internals -------------------------------------------------------
    def _least_loaded(self, cands: Sequence[_Candidate], view: "LinkLoads | DelayedView") -> _Candidate:
        """Global-First-Fit: the least-loaded candidate; ties go to the lowest lane id.
        (Candidates may come from several scopes: a joint choice of P, D and lane is
        this rule over the candidates of every (P, D) pair it may take.)"""
        if type(view) is LinkLoads and self.metric == "flows":  # the common case, inlined (every decision)
            return _least_flows(cands, view.flows.get, view.bytes.get)
        best: tuple[tuple[int, int, int], _Candidate] | None = None
        for c in cands:
            worst, total, worst_b = view.cost(c.core)
            key = (worst, total, c.lane.lane) if self.metric == "flows" else (worst_b, worst, c.lane.lane)
            if best is None or key < best[0]:
                best = (key, c)
        assert best is not None
        return best[1]

    def _apply(self, r: Reservation, sign: int, now: float) -> None:
        n = len(r.paths)
        if n == 1 and not (self.mode == "dc" and self.dc_delay_s > 0):  # one worker pair, no broadcast
            self.loads.add(r.paths[0].links, r.bytes, sign)
            return
        for i, path in enumerate(r.paths):
            # the bytes split evenly among the worker pairs (the remainder on the first)
            nbytes = r.bytes // n + (r.bytes % n if i == 0 else 0)
            self.loads.add(path.links, nbytes, sign)
            if self.mode == "dc" and self.dc_delay_s > 0 and path.links:
                self._unheard.push(LoadEvent(now, r.src_host, path.links, nbytes, sign))

    def _view(self, host: str, now: float) -> "DelayedView | LinkLoads":
        self._unheard.age_out(now - self.dc_delay_s)
        return DelayedView(self.loads, self._unheard, host) if self._unheard.events else self.loads
