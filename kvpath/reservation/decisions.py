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

Lanes are registered per (P worker, D worker) pair of a host pair: TP ranks, and
several engines on one host, each have their own lanes (their own 5-tuples and
paths) and never overwrite each other. A transfer is one flow per worker pair that
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
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence, runtime_checkable

import msgspec

from kvpath.fabric import FabricSpec, FabricSpecError, Path
from kvpath.oracle import ModelOracle, PathOracle
from kvpath.reservation.lane_log import LaneLog
from kvpath.reservation.link_loads import DelayedView, LinkLoads, LoadEvent, Unheard, core_links
from kvpath.reservation.wire import (MAX_EXPECTED_END_S, MAX_TRANSFER_BYTES, METRICS, MODES, FlowScope, LaneInfo,
                                    ReserveAnswer, WorkerPair)

__all__ = ["MODES", "METRICS", "FlowScope", "LaneInfo", "Reservation", "ReservationError", "ReservationService",
           "UnregisteredLanes", "WorkerPair", "default_lane"]

MAX_WORKER_PAIRS = 16384  # registered pairs over all host pairs: registrations beyond are refused
# lanes over all registered pairs (16 a pair on average; a P opens 8): what the registry,
# and the decision log's base of it, hold at most
MAX_REGISTERED_LANES = 262_144
MAX_UPDATES_PER_LEASE = 16  # a lease's updates, each kept in its decision record for replay
LEASE_EXTENSION_MAX = 10  # an update holds a lease at most this many lease times ahead
MAX_SCOPES_CACHED = 256  # per host pair: the candidate cache is dropped when it holds more
_UNSCOPED = FlowScope()


def default_lane(transfer_id: str, n_lanes: int) -> int:
    """The lane a transfer takes when nobody chose one (stable across processes): the
    connector's rule, which ``ecmp`` mode reproduces."""
    return zlib.crc32(transfer_id.encode()) % n_lanes


class ReservationError(ValueError):
    """Bad reservation input; the message names the field."""


class UnregisteredLanes(ReservationError):
    """A reservation named lanes the service does not know for the pair (the field: ``lanes``)."""


class _Registered(NamedTuple):
    pair: WorkerPair | None  # None: registered by a free-form name
    lanes: list[LaneInfo]
    at: float  # when it was last (re)registered, on the service's clock


class _Candidate(NamedTuple):
    """One lane id: its lane on the first carrying pair, and its path on every one (and
    their switch-to-switch links, each once: what cc compares)."""

    lane: LaneInfo
    paths: tuple[Path, ...]
    workers: tuple[str, ...]
    core: tuple[tuple[str, str], ...]


def _candidate(lane: LaneInfo, paths: tuple[Path, ...], workers: tuple[str, ...]) -> _Candidate:
    return _Candidate(lane, paths, workers, core_links(paths))


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


class _Cands(list):
    """A host pair's candidates (cached), with their decision-log form made once."""

    __slots__ = ("logged",)

    def log_form(self) -> tuple | None:
        """(lane, source port, destination port, spine) of each, as the decision log keeps
        them (None with several worker pairs: not replayable)."""
        try:
            return self.logged
        except AttributeError:
            self.logged = (tuple((c.lane.lane, c.lane.src_port, c.lane.dst_port, c.paths[0].spine) for c in self)
                           if all(len(c.paths) == 1 for c in self) else None)
            return self.logged


MAX_GIVEN_CACHED = 4096  # candidates of lanes named with a reservation, by (hosts, lanes)


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


class ReservationService:
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
        if not lanes_ttl_s > 0:
            raise ReservationError(f"lanes_ttl_s must be > 0, got {lanes_ttl_s!r}")
        # a worker pair not registered again for this long is forgotten (its P died
        # without unregistering); P's connector registers its pairs again every minute
        self.lanes_ttl_s = lanes_ttl_s
        self._next_lane_sweep = 0.0
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
        # (src, dst) -> worker pair's name -> its lanes, as P connectors register them
        self._lanes: dict[tuple[str, str], dict[str, _Registered]] = {}
        self._n_pairs = 0
        self._n_lanes = 0
        self._unheard = Unheard()  # dc: changes younger than the broadcast delay
        # per (src, dst) and set of worker pairs in scope: the candidates (lanes are long-lived)
        self._cands: dict[tuple[str, str], dict[tuple[str, ...], list[_Candidate]]] = {}
        self._given: OrderedDict[tuple, _Cands] = OrderedDict()
        self._canon: dict[str, str] = {}
        self.counters: dict[str, int] = defaultdict(int)
        # the last decisions (transfer id, lane, spine...), for the testbed's trace
        self.decisions: deque[dict] = deque(maxlen=100_000)
        # one sequence over reservations and their ends, so the decision log replays
        # in the order the service saw it (kvpath/reservation/replay.py)
        self._seq = itertools.count(1)
        self._open_decisions: dict[str, dict] = {}  # lease id -> its decision record, while active
        # the lane registry's changes, on the same sequence: a placement's replay needs the
        # lanes of every pair it could have chosen, not only the chosen pair's
        self.lane_log = LaneLog()

    # ---- lane registry (filled by P connectors when they open lanes) -------
    def register_lanes(self, src_host: str, dst_host: str, lanes: Sequence[LaneInfo], worker: str = "",
                       pair: WorkerPair | None = None) -> None:
        """(Re)register the lanes of one (P worker, D worker) pair, e.g. after a lane
        reopened or its D restarted (a new incarnation replaces the old one's lanes)."""
        src, dst = self._host(src_host, "src_host"), self._host(dst_host, "dst_host")
        self._check_lanes(lanes)
        key = self._pair_key(worker, pair)
        now = self.clock()
        self._sweep_lanes(now)  # first: a pair it drops is then registered anew (and logged)
        pairs = self._lanes.get((src, dst), {})
        old = pairs.get(key)
        if pair is None and old is not None and old.pair is not None:
            raise ReservationError(f"worker {worker!r} is a pair registered by engines and ranks: register it "
                                   f"again with its pair, not by name")
        new = sorted(lanes, key=lambda x: x.lane)
        changed = old is None or (old.pair, old.lanes) != (pair, new)  # (not P's minutely refresh)
        # the log's form first (the oracle may fail): the registry and its log change together
        logged = self._lane_spines(src, dst, new) if changed else None
        if key not in pairs and self._n_pairs >= MAX_WORKER_PAIRS:
            self.counters["lane_registrations_refused"] += 1
            raise ReservationError(f"worker: {MAX_WORKER_PAIRS} worker pairs are registered already; "
                                   f"unregister the pairs of engines that went away")
        n_lanes = self._n_lanes - (len(old.lanes) if old else 0) + len(new)
        if n_lanes > MAX_REGISTERED_LANES:
            self.counters["lane_registrations_refused"] += 1
            raise ReservationError(f"lanes: {MAX_REGISTERED_LANES} lanes are registered already over all worker "
                                   f"pairs; unregister the pairs of engines that went away")
        if key not in pairs:
            self._n_pairs += 1
        self._n_lanes = n_lanes
        reg = self._lanes.setdefault((src, dst), {})[key] = _Registered(pair, new, now)
        self._cands.pop((src, dst), None)
        if logged is not None:
            self._log_lanes(src, dst, key, reg, logged)
        self.counters["lane_registrations"] += 1

    def unregister_lanes(self, src_host: str, dst_host: str, worker: str = "", pair: WorkerPair | None = None) -> int:
        """Forget one worker pair's lanes (its engine went away); returns how many there
        were. With a ``pair`` that names an incarnation, only that incarnation's lanes
        go (a newer one's stay). Leases already granted keep their load until they end."""
        key = (self._host(src_host, "src_host"), self._host(dst_host, "dst_host"))
        name = self._pair_key(worker, pair)
        pairs = self._lanes.get(key, {})
        got = pairs.get(name)
        if got is None:
            return 0
        if got.pair is not None and (pair is None or pair.incarnation != got.pair.incarnation):
            # a pair registered by engines is removed only by its own incarnation (a late
            # removal from before a restart, or one by name, leaves the new lanes alone)
            self.counters["lane_unregistrations_stale"] += 1
            return 0
        self._drop_pair(key, name)
        self.counters["lane_unregistrations"] += 1
        return len(got.lanes)

    def _drop_pair(self, key: tuple[str, str], name: str) -> None:
        pairs = self._lanes[key]
        gone = pairs.pop(name)
        self._n_pairs -= 1
        self._n_lanes -= len(gone.lanes)
        if not pairs:
            del self._lanes[key]
        self._cands.pop(key, None)
        self._log_lanes(*key, name, gone, None)

    def _lane_spines(self, src: str, dst: str, lanes: Sequence[LaneInfo]) -> tuple:
        """(lane, source port, destination port, protocol, spine) of each lane, the spine as
        this service's oracle sees it (one batch where the oracle batches)."""
        keys = [(src, dst, ln.src_port, ln.dst_port, ln.proto) for ln in lanes]
        try:
            batch = getattr(self.oracle, "paths", None)
            paths = batch(keys) if batch is not None else [self.oracle.path(*k) for k in keys]
        except (RuntimeError, FabricSpecError, OSError) as e:
            raise ReservationError(f"lanes: no path known for a lane of {src}->{dst}: {e}") from None
        if len(paths) != len(lanes):
            raise ReservationError(f"lanes: the path oracle answered {len(paths)} paths for {len(lanes)} lanes")
        return tuple((ln.lane, ln.src_port, ln.dst_port, ln.proto, p.spine) for ln, p in zip(lanes, paths))

    def _log_lanes(self, src: str, dst: str, name: str, reg: _Registered, lanes: tuple | None) -> None:
        """One change of the registry (``lanes`` None: the pair is gone), on the service's
        clock (``t``) and the wall clock (``at``): what a replay needs to rebuild it."""
        self.lane_log.record({"seq": next(self._seq), "at": time.time(), "t": self.clock(), "src_host": src,
                              "dst_host": dst, "worker": name, "lanes": lanes,
                              "pair": msgspec.to_builtins(reg.pair) if reg.pair else None})

    def _sweep_lanes(self, now: float) -> None:
        """Forget the worker pairs not registered again within lanes_ttl_s (looked at
        every tenth of it, so the cost does not grow with the calls)."""
        if now < self._next_lane_sweep:
            return
        self._next_lane_sweep = now + self.lanes_ttl_s / 10
        for key, pairs in list(self._lanes.items()):
            for name, reg in list(pairs.items()):
                if now - reg.at > self.lanes_ttl_s:
                    self._drop_pair(key, name)
                    self.counters["lane_registrations_expired"] += 1

    def lanes(self, src_host: str, dst_host: str, worker: str = "", pair: WorkerPair | None = None) -> list[LaneInfo]:
        key = (self._host(src_host, "src_host"), self._host(dst_host, "dst_host"))
        got = self._lanes.get(key, {}).get(self._pair_key(worker, pair))
        return list(got.lanes) if got else []

    def check_registered(self, src_host: str, dst_host: str, lanes: Sequence[LaneInfo],
                         scope: FlowScope | None = None) -> None:
        """An :class:`UnregisteredLanes` error unless every one of ``lanes`` is a
        lane registered for the host pair by a worker pair in ``scope`` (same lane id,
        ports and protocol; addresses, when given, the registered ones). The HTTP
        service asks this before a reservation that names its lanes: a caller may narrow
        the candidates to lanes P has, never make up a lane (a 5-tuple P never opened)."""
        src, dst = self._host(src_host, "src_host"), self._host(dst_host, "dst_host")
        scope = scope if isinstance(scope, FlowScope) else _UNSCOPED
        known: dict[tuple[int, int, int, str], list[LaneInfo]] = {}
        for reg in self._lanes.get((src, dst), {}).values():
            if scope.matches(reg.pair):
                for ln in reg.lanes:
                    known.setdefault((ln.lane, ln.src_port, ln.dst_port, ln.proto), []).append(ln)
        for ln in lanes:
            same = known.get((ln.lane, ln.src_port, ln.dst_port, ln.proto), ())
            if not any((not ln.src_ip or ln.src_ip == r.src_ip) and (not ln.dst_ip or ln.dst_ip == r.dst_ip)
                       for r in same):
                raise UnregisteredLanes(f"lanes: lane {ln.lane} (source port {ln.src_port}) is not a lane registered "
                                       f"for {src}->{dst}" + ("" if scope.is_empty() else " in this scope")
                                       + ": only lanes P's connector registered can be reserved")

    @staticmethod
    def _pair_key(worker: str, pair: WorkerPair | None) -> str:
        if not isinstance(worker, str) or len(worker) > 512:
            raise ReservationError("worker must be a string of at most 512 characters")
        if pair is None:
            return worker
        if worker and worker != pair.key():
            raise ReservationError(f"worker {worker!r} and pair {pair.key()!r} name different worker pairs")
        return pair.key()

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
            self.counters["fallback_no_lanes"] += 1
            return Reservation(lease_id, tid, src, dst, nbytes, None, None, None, 0.0, self.mode, "no_lanes")
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
            self._rand, k = secrets.token_hex(6 * 1024), 0
        self._rand_at = k + 12
        return f"r{next(self._ids)}-{self._rand[k:k + 12]}"

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
        decision = {"transfer_id": tid, "lease_id": lease_id, "src_host": src, "dst_host": dst,
                    "bytes": nbytes, "lane": r.lane, "src_port": r.src_port, "spine": r.path.spine,
                    "spines": tuple(p.spine for p in paths), "workers": chosen.workers,
                    "at": time.time(), "t": now, "mode": self.mode,
                    "seq": next(self._seq),
                    # what it chose among (the first worker pair's lanes): enough to replay it.
                    # Tuples, not lists: the log keeps up to 100,000 records and the garbage
                    # collector stops tracking tuples of scalars, but rescans lists on every pass.
                    "candidates": cands.log_form() if isinstance(cands, _Cands) else _Cands(cands).log_form()}
        if extra:
            decision.update(extra)
        self.decisions.append(decision)
        self._open_decisions[lease_id] = decision
        return r

    def log_fallback(self, src: str, dst: str, nbytes: int, tid: str, now: float, extra: dict) -> None:
        """A decision that reserved nothing (no lane known for the pair it chose) in the
        log all the same: a placement's P and D are still a choice to replay."""
        decision = {"transfer_id": tid, "lease_id": "", "src_host": src, "dst_host": dst, "bytes": nbytes,
                    "lane": None, "src_port": None, "spine": None, "spines": (), "workers": (), "at": time.time(),
                    "t": now, "mode": self.mode, "seq": next(self._seq), "candidates": (), "fallback": "no_lanes"}
        decision.update(extra)
        self.decisions.append(decision)

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
    def _host(self, host: str, field_name: str) -> str:
        c = self._canon.get(host) if isinstance(host, str) else None
        if c is not None:
            return c
        if not isinstance(host, str) or not host:
            raise ReservationError(f"{field_name} must be a host name or IP of the fabric")
        try:
            c = self.spec.canonical(host)
        except FabricSpecError as e:
            raise ReservationError(f"{field_name}: {e}") from None
        if len(self._canon) < 100_000:  # bounded: names come from clients
            self._canon[host] = c
        return c

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

    def candidates(self, src: str, dst: str, scope: FlowScope | None = None) -> list[_Candidate]:
        """The registered lanes of host pair (``src``, ``dst``) in ``scope``, each with its
        path on every worker pair that carries it (canonical host names)."""
        return self._candidates(src, dst, None, scope or _UNSCOPED)

    def _candidates(self, src: str, dst: str, lanes: Sequence[LaneInfo] | None, scope: FlowScope) -> list[_Candidate]:
        """Per lane id: its lane (on the first carrying pair) and its path on every worker
        pair in ``scope``. Only lane ids that every such pair has are candidates."""
        if lanes:  # given with the request: one worker pair (cached by the lanes, LRU)
            key = (src, dst, tuple(lanes))
            got = self._given.get(key)
            if got is None:
                self._check_lanes(lanes)  # (a cached set passed it)
                got = self._given[key] = _Cands(
                    _candidate(c, (self.oracle.path(src, dst, c.src_port, c.dst_port, c.proto),), ())
                    for c in sorted(lanes, key=lambda x: x.lane))
                if len(self._given) > MAX_GIVEN_CACHED:
                    self._given.popitem(last=False)
            else:
                self._given.move_to_end(key)
            return got
        registered = self._lanes.get((src, dst))
        if not registered:
            return []
        # cached by the pairs in scope, not by the scope: a caller's made-up scopes match
        # no pair (nothing cached) or the same pairs as a real one
        names = tuple(sorted(name for name, reg in registered.items() if scope.matches(reg.pair)))
        if not names:
            return []
        cache = self._cands.setdefault((src, dst), {})
        got = cache.get(names)
        if got is None:
            pairs = [registered[name].lanes for name in names]
            common = set.intersection(*({c.lane for c in ls} for ls in pairs))
            got = _Cands()
            for lane_id in sorted(common):
                per = [next(c for c in ls if c.lane == lane_id) for ls in pairs]
                got.append(_candidate(per[0], tuple(self.oracle.path(src, dst, c.src_port, c.dst_port, c.proto)
                                                    for c in per), names))
            if len(cache) >= MAX_SCOPES_CACHED:  # keep the cache bounded
                cache.clear()
            cache[names] = got
        return got

    @staticmethod
    def _check_lanes(lanes: Sequence[LaneInfo]) -> None:
        seen = set()
        for ln in lanes:
            if not isinstance(ln.lane, int) or ln.lane < 0 or ln.lane in seen:
                raise ReservationError(f"lanes: bad or repeated lane id {ln.lane!r}")
            if not 0 <= ln.src_port < 65536 or not 0 <= ln.dst_port < 65536:
                raise ReservationError(f"lanes: lane {ln.lane} has a port outside [0, 65535]")
            seen.add(ln.lane)

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
