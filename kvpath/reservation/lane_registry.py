"""The lane registry of the reservation service: which lanes (5-tuples, so which paths)
each (P worker, D worker) pair of a host pair has, as P's connectors register them, and
the candidates a decision chooses among.

Lanes are registered per (P worker, D worker) pair of a host pair: TP ranks, and
several engines on one host, each have their own lanes (their own 5-tuples and
paths) and never overwrite each other. A worker pair not registered again within
``lanes_ttl_s`` is forgotten. Every change of the registry goes to the decision log's
lane log (kvpath/reservation/lane_log.py), so a placement replays against the registry
it saw. :class:`LaneRegistry` is the part of :class:`~kvpath.reservation.decisions.ReservationService`
that keeps it (the service sets up its state with ``_init_registry``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import msgspec

from kvpath.fabric import FabricSpec, FabricSpecError, Path
from kvpath.oracle import PathOracle
from kvpath.reservation.lane_log import LaneLog
from kvpath.reservation.link_loads import core_links
from kvpath.reservation.wire import FlowScope, LaneInfo, WorkerPair

__all__ = ["LaneRegistry", "ReservationError", "UnregisteredLanes", "MAX_WORKER_PAIRS", "MAX_REGISTERED_LANES"]

MAX_WORKER_PAIRS = 16384  # registered pairs over all host pairs: registrations beyond are refused
# lanes over all registered pairs (16 a pair on average; a P opens 8): what the registry,
# and the decision log's base of it, hold at most
MAX_REGISTERED_LANES = 262_144
MAX_SCOPES_CACHED = 256  # per host pair: the candidate cache is dropped when it holds more
_UNSCOPED = FlowScope()


class ReservationError(ValueError):
    """Bad reservation input; the message names the field."""


class UnregisteredLanes(ReservationError):
    """A reservation named lanes the service does not know for the pair (the field: ``lanes``)."""


class _Registered(msgspec.Struct, frozen=True, gc=False):
    """Untracked by the garbage collector (scalars and tuples of lanes: no cycle)."""

    pair: WorkerPair | None  # None: registered by a free-form name
    lanes: tuple[LaneInfo, ...]
    at: float  # when it was last (re)registered, on the service's clock


class _Candidate(msgspec.Struct, frozen=True, gc=False):
    """One lane id: its lane on the first carrying pair, and its path on every one (and
    their switch-to-switch links, each once: what cc compares). Untracked by the garbage
    collector, as paths are (kvpath.fabric.Path): it holds tuples of strings, lanes and
    paths, so no reference cycle can pass through it."""

    lane: LaneInfo
    paths: tuple[Path, ...]
    workers: tuple[str, ...]
    core: tuple[tuple[str, str], ...]
    # each path's spine, as the decision log keeps them: made once, so that a decision's
    # record holds only old tuples and scalars and the collector never tracks it
    spines: tuple[str | None, ...]


def _candidate(lane: LaneInfo, paths: tuple[Path, ...], workers: tuple[str, ...]) -> _Candidate:
    return _Candidate(lane, paths, workers, core_links(paths), tuple(p.spine for p in paths))


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


class LaneRegistry:
    """The registry's state and calls. The class that uses it provides ``spec``,
    ``oracle``, ``clock``, ``counters`` and ``_seq`` (the decision log's one sequence)."""

    spec: FabricSpec
    oracle: PathOracle
    clock: Callable[[], float]
    counters: dict[str, int]
    _seq: Iterator[int]

    def _init_registry(self, lanes_ttl_s: float) -> None:
        if not lanes_ttl_s > 0:
            raise ReservationError(f"lanes_ttl_s must be > 0, got {lanes_ttl_s!r}")
        # a worker pair not registered again for this long is forgotten (its P died
        # without unregistering); P's connector registers its pairs again every minute
        self.lanes_ttl_s = lanes_ttl_s
        self._next_lane_sweep = 0.0
        # (src, dst) -> worker pair's name -> its lanes, as P connectors register them
        self._lanes: dict[tuple[str, str], dict[str, _Registered]] = {}
        self._n_pairs = 0
        self._n_lanes = 0
        # per (src, dst) and set of worker pairs in scope: the candidates (lanes are long-lived)
        self._cands: dict[tuple[str, str], dict[tuple[str, ...], list[_Candidate]]] = {}
        self._given: OrderedDict[tuple, _Cands] = OrderedDict()
        self._canon: dict[str, str] = {}
        # the lane registry's changes, on the decisions' sequence: a placement's replay needs
        # the lanes of every pair it could have chosen, not only the chosen pair's
        self.lane_log = LaneLog()

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
        new = tuple(sorted(lanes, key=lambda x: x.lane))
        if key not in pairs and self._n_pairs >= MAX_WORKER_PAIRS:
            self.counters["lane_registrations_refused"] += 1
            raise ReservationError(f"worker: {MAX_WORKER_PAIRS} worker pairs are registered already; "
                                   f"unregister the pairs of engines that went away")
        n_lanes = self._n_lanes - (len(old.lanes) if old else 0) + len(new)
        if n_lanes > MAX_REGISTERED_LANES:
            self.counters["lane_registrations_refused"] += 1
            raise ReservationError(f"lanes: {MAX_REGISTERED_LANES} lanes are registered already over all worker "
                                   f"pairs; unregister the pairs of engines that went away")
        changed = old is None or (old.pair, old.lanes) != (pair, new)  # (not P's minutely refresh)
        # the log's form before any change (the oracle may fail): the registry and its log change together
        logged = self._lane_spines(src, dst, new) if changed else None
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
