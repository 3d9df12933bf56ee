"""P's lane set-up: the pool of lane agents, the path oracle, the handshake with each
D worker (compatibility, then opening and probing its lanes with a
:class:`~kvpath.connector.lanes.LaneSet`), and telling D and the reservation service
the lanes' 5-tuples. This part owns the D workers it knows (``peers``) and the set-ups
queued or in progress. Every method runs on the writer thread except :meth:`LaneSetup.lanes`
and :meth:`LaneSetup.worker_pair`, which only read.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator

from kvpath.connector import messages as M
from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.control_channel import ControlChannel
from kvpath.connector.lanes import Lane, LaneSet
from kvpath.connector.layout import LayoutMismatch, check_compatible
from kvpath.connector.nixl_io import PROBE_BYTES, make_agent
from kvpath.connector.telemetry import Stats
from kvpath.connector.tp_map import compat_refusal, layouts_refusal
from kvpath.reservation.notifier import ReservationNotifier
from kvpath.reservation.wire import LaneInfo, WorkerPair
from kvpath.trace import LaneRecord, LanesRecord

if TYPE_CHECKING:
    from kvpath.oracle import KernelOracle, ModelOracle

logger = logging.getLogger(__name__)

# D workers one P knows at once (each holds a NIXL remote agent per lane): beyond it, the
# least recently seen idle one is forgotten, or the new one refused when all are busy.
MAX_PEERS = 1024
# Lane set-ups waiting behind the one in progress (each is at most lanes x candidates
# probes of up to PROBE_TIMEOUT_S): beyond it a new D is told to try again later.
MAX_QUEUED_SETUPS = 64
# P registers each D worker's lanes again this often: the reservation service forgets
# pairs not registered for its lanes_ttl_s (900 s by default), e.g. of a P that was killed
LANE_REFRESH_S = 60.0


@dataclass
class Peer:
    """A D worker that completed the handshake."""

    hello: M.Hello
    ident: bytes  # its control-channel identity
    lanes: LaneSet
    last_seen: float = 0.0  # monotonic time of its last Hello or Register
    registered_at: float = 0.0  # monotonic time its lanes were last registered with the reservation service


@dataclass
class LaneOpening:
    """A D worker's lane set-up in progress (the writer steps one at a time)."""

    hello: M.Hello
    ident: bytes
    lanes: LaneSet
    steps: Generator[None, None, None]
    reopen: int | None = None  # a known peer's lane being reopened (else: a new peer's set-up)


class LaneSetup:
    """P's lanes to each D worker: the handshake, the set-ups, the peers known."""

    def __init__(
        self, cfg: KVPathConfig, layout: M.BlockLayout, compat: M.Compat, engine_id: str, rank: int,
        stats: Stats, channel: ControlChannel, *, spans: list[tuple[int, int]], probe_addr: int,
        register_memory: Callable[[Any, list[tuple[int, int]], str, int], None], record: Callable[[Any], None],
        on_lanes: Callable[[str, list[Lane]], None] | None, on_reopen_ended: Callable[[str, str | None], None],
        busy: Callable[[], set[str]],
    ):
        self.cfg, self.layout, self.compat = cfg, layout, compat
        self.engine_id, self.rank, self.stats, self.channel = engine_id, rank, stats, channel
        self._spans, self._probe_addr = spans, probe_addr
        self._register_memory, self._record = register_memory, record
        self._on_lanes = on_lanes
        self._on_reopen_ended = on_reopen_ended  # a reopen ended: the write loop resumes or fails its pushes
        self._busy = busy  # D agent names the other parts hold something for (never forgotten)
        self.agents: list[Any] = []  # the pool of lane agents
        self.oracle: ModelOracle | KernelOracle | None = None  # set by make_oracle() when a fabric spec is given
        self.notifier: ReservationNotifier | None = None  # set by the sender's start()
        self.peers: dict[str, Peer] = {}  # D agent name -> the D worker
        self.opening: LaneOpening | None = None  # the lane set-up in progress
        self.queued: OrderedDict[str, tuple[bytes, M.Hello]] = OrderedDict()  # set-ups queued behind it
        self.reopens: OrderedDict[tuple[str, int], None] = OrderedDict()  # (D agent, lane) to reopen

    @property
    def instance(self) -> str:
        return self.channel.instance

    def setting_up(self) -> bool:
        """A set-up runs or waits (the writer polls its probes every millisecond)."""
        return self.opening is not None or bool(self.queued) or bool(self.reopens)

    def peer(self, name: str) -> Peer | None:
        return self.peers.get(name)

    def peer_of(self, ident: bytes) -> Peer | None:
        """The D worker behind a control-channel identity."""
        return next((p for p in self.peers.values() if p.ident == ident), None)

    def heartbeat_s(self) -> float:
        """How often D workers expect P's heartbeat (the most frequent asked)."""
        return min((p.hello.heartbeat_s for p in self.peers.values()), default=1.0)

    def drop_reopens_of(self, name: str) -> None:
        """D ``name`` is unreachable: its other queued reopens would each spend a probe timeout."""
        for key in [k for k in self.reopens if k[0] == name]:
            del self.reopens[key]

    def make_oracle(self) -> None:
        self.oracle = None
        if self.cfg.fabric_spec:
            from kvpath.fabric import FabricSpec, FabricSpecError
            from kvpath.oracle import KernelOracle, ModelOracle

            try:
                spec = FabricSpec.resolve(self.cfg.fabric_spec)
                prefix = self.cfg.kernel_oracle
                self.oracle = KernelOracle.for_prefix(spec, prefix) if prefix else ModelOracle(spec)
            except (FabricSpecError, OSError) as e:
                raise ConfigError(f"kv_connector_extra_config.fabric_spec: {e}") from e

    def make_agents(self) -> None:
        # With a path oracle the pool holds lane_candidates agents per lane, so each
        # D peer's lanes can be picked to cover distinct paths.
        pool = self.cfg.lanes * (self.cfg.lane_candidates if self.oracle else 1)
        # A NIXL notification names its sender by the agent's own claim: D accepts one only
        # from the agents P's Welcome (over the authenticated channel) listed, so the names
        # carry 64 random bits that nobody outside that channel can guess.
        nonce = secrets.token_hex(8)
        for i in range(pool):
            agent = make_agent(f"{self.engine_id}-r{self.rank}-{nonce}-lane{i}")
            self._register_memory(agent, self._spans, self.layout.mem_type, self.layout.device_id)
            self._register_memory(agent, [(self._probe_addr, PROBE_BYTES)], "DRAM", 0)
            self.agents.append(agent)

    def same_sizes(self, hello: M.Hello) -> bool:
        """P and this D worker have equal TP and block sizes: blocks are copied as they are."""
        return hello.compat.tp_size == self.compat.tp_size and hello.layout.block_size == self.layout.block_size

    def worker_pair(self, hello: M.Hello) -> WorkerPair:
        """The (P worker, D worker) pair in the reservation service: engines and ranks
        (what the proxy's reservations select on); its incarnation names both processes
        (P's instance, D's agent), so a restarted P or D is another incarnation."""
        incarnation = f"{self.instance}>{hello.agent_name}"
        if len(incarnation) > 256:
            incarnation = hashlib.sha256(incarnation.encode()).hexdigest()
        return WorkerPair(p_engine=self.engine_id, p_rank=self.rank, d_engine=hello.engine_id,
                          d_rank=hello.compat.tp_rank, incarnation=incarnation)

    def lanes(self) -> dict[str, list[Lane]]:
        """D agent name -> its lanes (a snapshot; for tests and tools)."""
        return {name: list(p.lanes.lanes) for name, p in self.peers.items()}

    def on_hello(self, ident: bytes, hello: M.Hello) -> None:
        """The handshake: refuse an incompatible peer naming the field, else open lanes."""
        self.stats.inc("handshakes")
        bad = compat_refusal(self.compat, hello.compat)
        if bad is None and not self.same_sizes(hello):
            bad = layouts_refusal(self.layout, self.compat, hello.layout, hello.compat)
        elif bad is None:
            try:
                check_compatible(self.layout, hello.layout)
            except LayoutMismatch as e:
                bad = ("kv_layout", str(e))
        if bad is not None:
            self.stats.inc("handshakes_refused")
            logger.error("refused D %s (%s): %s", hello.engine_id, hello.agent_name, bad[1])
            self.channel.send(ident, M.Welcome(self.instance, False, bad[0], bad[1]))
            return
        peer = self.peers.get(hello.agent_name)
        if peer is not None and peer.ident != ident:  # the agent's name, another key's connection
            self.stats.inc("messages_unbound")
            logger.warning("dropped a Hello for agent %s from another connection", hello.agent_name)
            return
        if peer is None and self._setup_pending(hello.agent_name):
            self._queue_lane_setup(ident, hello)  # a re-sent Hello: checked and dropped there
            return
        if peer is None and len(self.peers) + len(self.queued) + (self.opening is not None) >= MAX_PEERS:
            self.prune(time.monotonic(), need_room=True)
            if len(self.peers) + len(self.queued) + (self.opening is not None) >= MAX_PEERS:
                self.stats.inc("peers_over_limit")
                logger.warning("refused D %s: %d D workers known, all of them busy", hello.agent_name, MAX_PEERS)
                self.channel.send(ident, M.Welcome(self.instance, False, "peers",
                                            f"this P serves at most {MAX_PEERS} D workers at once"))
                return
        if peer is None:
            self._queue_lane_setup(ident, hello)
            return
        peer.ident = ident
        peer.last_seen = time.monotonic()
        self.welcome(peer)

    def _setup_pending(self, name: str) -> bool:
        op = self.opening
        return name in self.queued or (op is not None and op.reopen is None and op.hello.agent_name == name)

    def _queue_lane_setup(self, ident: bytes, hello: M.Hello) -> None:
        """Open this D worker's lanes on the writer's loop, one probe at a time, after the
        set-ups queued before it; its Welcome goes out when they are open. D re-sends its
        Hello while it waits: a set-up already queued or running is not started again."""
        name = hello.agent_name
        op = self.opening
        held = (op.ident if op is not None and op.reopen is None and op.hello.agent_name == name
                else self.queued[name][0] if name in self.queued else None)
        if held is not None:
            if held != ident:
                self.stats.inc("messages_unbound")
                logger.warning("dropped a Hello for agent %s from another connection", name)
            return
        if len(self.queued) >= MAX_QUEUED_SETUPS:
            self.stats.inc("peers_over_limit")
            self.channel.send(ident, M.Welcome(self.instance, False, "peers",
                                        f"{MAX_QUEUED_SETUPS} lane set-ups are queued at this P; try again"))
            return
        self.queued[name] = (ident, hello)
        self.step()

    def queue_reopen(self, peer: Peer, lane: int) -> bool:
        """Queue a reopen of a broken lane; False when the queue is full."""
        key = (peer.hello.agent_name, lane)
        if key in self.reopens or self._reopening(key):
            return True
        if len(self.reopens) >= MAX_QUEUED_SETUPS:
            return False
        self.reopens[key] = None
        return True

    def _reopening(self, key: tuple[str, int]) -> bool:
        op = self.opening
        return op is not None and op.reopen == key[1] and op.hello.agent_name == key[0]

    def _next_lane_setup(self) -> LaneOpening | None:
        """The next set-up to run: lane reopens of known peers first (a push waits on
        them), then new peers' set-ups, in arrival order."""
        while self.reopens:
            (name, lane), _ = self.reopens.popitem(last=False)
            peer = self.peers.get(name)
            if peer is not None and peer.lanes.lanes[lane].broken:
                return LaneOpening(peer.hello, peer.ident, peer.lanes, peer.lanes.reopen_steps(lane), reopen=lane)
            # open again meanwhile, or the peer was forgotten: its waiting pushes go on (or fail)
            self._on_reopen_ended(name, None if peer is not None else "D was forgotten while its lane reopened")
        if not self.queued:
            return None
        _, (ident, hello) = self.queued.popitem(last=False)
        try:
            rule = self._path_rule(hello)
        except Exception as e:  # e.g. a fabric_host the fabric spec does not know
            logger.warning("cannot open lanes to %s: %s", hello.agent_name, e)
            self.channel.send(ident, M.Welcome(self.instance, False, "fabric_host", f"lane set-up failed: {e}"))
            return None
        lanes = LaneSet(hello, self.agents, self._probe_addr, int(self.channel.address.rpartition(":")[2]),
                        self.cfg.lanes, *rule)
        return LaneOpening(hello, ident, lanes, lanes.open_steps())

    def step(self) -> None:
        """Advance the lane set-up in progress by one probe poll (or start the next)."""
        if self.opening is None:
            self.opening = self._next_lane_setup()
            if self.opening is None:
                return
        op = self.opening
        try:
            next(op.steps)
            return  # a probe is in flight
        except StopIteration:
            self.opening = None
        except Exception as e:  # a peer we cannot reach: refuse it, the others were served meanwhile
            self.opening = None
            logger.warning("cannot open lanes to %s: %s", op.hello.agent_name, e)
            if op.reopen is not None:  # the lane stays broken; its next use queues it again
                self._on_reopen_ended(op.hello.agent_name, f"reopening lane {op.reopen} to D failed: {e}")
                return
            op.lanes.abandon()
            self.channel.send(op.ident, M.Welcome(self.instance, False, "lanes", f"lane set-up failed: {e}"))
            return
        if op.reopen is not None:
            peer = self.peers.get(op.hello.agent_name)
            if peer is not None:  # D learns the new connection before any byte moves on it
                self.welcome(peer)
                self.register_lanes(peer)
            self._on_reopen_ended(op.hello.agent_name, None if peer is not None else "D was forgotten")
            return
        peer = self.peers[op.hello.agent_name] = Peer(op.hello, op.ident, op.lanes, last_seen=time.monotonic())
        self._lanes_opened(peer)
        self.welcome(peer)

    def abandon(self) -> None:
        """Shutdown: the set-up in progress leaves no remote agent; queued ones are dropped."""
        if self.opening is not None:
            try:
                self.opening.steps.close()
            except Exception:
                logger.debug("closing a lane set-up failed", exc_info=True)
            if self.opening.reopen is None:
                self.opening.lanes.abandon()
            self.opening = None
        self.queued.clear()
        self.reopens.clear()

    def drop_all(self) -> None:
        """Shutdown: every D worker's lanes torn down and unregistered, the agents dropped."""
        self.abandon()
        for peer in list(self.peers.values()):
            for i in range(len(peer.lanes.lanes)):
                peer.lanes.tear_down(i)
            self.unregister_lanes(peer)  # sent by the notifier's close, after this
        self.peers.clear()
        self.agents = []

    def prune(self, now: float, need_room: bool = False) -> None:
        """Forget D workers that hold nothing here and sent nothing for
        peer_idle_timeout_s (a restarted or departed D leaves its old agent behind);
        ``need_room``: also the least recently seen idle one, to make room for a new D."""
        busy = self._busy()  # registrations held, pushes in flight, asking or parked
        busy |= {name for name, _ in self.reopens}  # a lane of theirs is reopening
        if self.opening is not None:
            busy.add(self.opening.hello.agent_name)
        idle = sorted((p.last_seen, name) for name, p in self.peers.items() if name not in busy)
        for last_seen, name in idle:
            if now - last_seen > self.cfg.peer_idle_timeout_s:
                self.forget(self.peers[name], f"idle for {now - last_seen:.0f}s")
        if need_room and len(self.peers) >= MAX_PEERS:
            rest = [name for _, name in idle if name in self.peers]
            if rest:
                self.forget(self.peers[rest[0]], "the least recently seen, to make room")

    def forget(self, peer: Peer, why: str) -> None:
        """Release a D worker's lanes (its NIXL remote agent on each lane agent) and
        forget it; a later Register from it is answered unknown_peer (D says Hello again)."""
        for i in range(len(peer.lanes.lanes)):
            peer.lanes.tear_down(i)
        self.unregister_lanes(peer)
        del self.peers[peer.hello.agent_name]
        self.stats.inc("peers_forgotten")
        logger.info("forgot D %s (%s)", peer.hello.agent_name, why)

    def welcome(self, peer: Peer) -> None:
        lanes = [(l.src_ip, l.src_port) for l in peer.lanes.lanes if l.src_port]
        # D accepts a push's notification only from these (the agents of our lanes).
        agents = sorted({peer.lanes.agent(i).name for i in range(len(peer.lanes.lanes))})
        complete = len(lanes) == len(peer.lanes.lanes)  # else D's fence cannot see them all
        self.channel.send(peer.ident, M.Welcome(self.instance, True, lanes=lanes, agents=agents, complete=complete))

    def _path_rule(self, hello: M.Hello) -> tuple[Callable[[Lane], str] | None, int]:
        """(lane -> its path, how many paths there are) between us and ``hello``'s
        host, when a fabric spec names both hosts; else no rule."""
        src, dst = self.cfg.fabric_host, hello.fabric_host
        if self.oracle is None or not src or not dst:
            return None, 1
        spec = self.oracle.spec
        n_paths = spec.spines if spec.locate(src)[0] != spec.locate(dst)[0] else 1

        def path_of(lane: Lane) -> str:
            p = self.oracle.path(src, dst, lane.src_port, lane.dst_port)
            return p.spine or "->".join(p.nodes)

        return path_of, n_paths

    def _lanes_opened(self, peer: Peer) -> None:
        lanes, h = peer.lanes.lanes, peer.hello
        self.stats.inc("lanes_opened", len(lanes))
        logger.info("opened %d lanes to %s (%d candidates tried): %s", len(lanes), h.agent_name,
                    peer.lanes.candidates_opened or len(lanes),
                    [f"{l.src_ip}:{l.src_port}->{l.dst_ip}:{l.dst_port}{' via ' + l.path if l.path else ''}"
                     for l in lanes])
        self._record(LanesRecord(peer=h.agent_name, engine=self.engine_id, lanes=[
            LaneRecord(lane=l.lane_id, five_tuple=l.five_tuple(), path=l.path or None) for l in lanes]))
        self.register_lanes(peer)
        if self._on_lanes:
            try:
                self._on_lanes(h.agent_name, list(lanes))
            except Exception:  # a telemetry callback must never break pushes
                logger.exception("on_lanes callback failed")

    def register_lanes(self, peer: Peer) -> None:
        """Tell the reservation service this worker pair's lanes (full 5-tuples)."""
        h = peer.hello
        if self.notifier is not None and self.cfg.fabric_host and h.fabric_host:
            pair = self.worker_pair(h)
            bad = WorkerPair.engine_id_problem(pair.p_engine) or WorkerPair.engine_id_problem(pair.d_engine)
            if bad:  # the service would refuse it: say so once per D, not at debug level
                if peer.registered_at == 0.0:
                    logger.warning("lanes to %s are not registered with the reservation service: %s",
                                   h.agent_name, bad)
                    self.stats.inc("lane_registrations_skipped")
                peer.registered_at = time.monotonic()
                return
            twin = None if peer.registered_at else next(
                (p for p in self.peers.values() if p is not peer and p.hello.engine_id == h.engine_id
                 and p.hello.compat.tp_rank == h.compat.tp_rank and p.hello.fabric_host == h.fabric_host), None)
            if twin is not None:
                # two live D workers that name one pair: their registrations replace each other
                logger.warning("D workers %s and %s share engine id %r and rank %d on %s: give each engine its "
                               "own engine_id, or the reservation service sees one of them", h.agent_name,
                               twin.hello.agent_name, h.engine_id, h.compat.tp_rank, h.fabric_host)
                self.stats.inc("worker_pair_collisions")
            rows = [LaneInfo(l.lane_id, l.src_port, l.dst_port, l.src_ip, l.dst_ip) for l in peer.lanes.lanes
                    if l.src_port]
            self.notifier.register_lanes(self.cfg.fabric_host, h.fabric_host, rows, pair=pair)
            peer.registered_at = time.monotonic()

    def refresh_registrations(self, now: float) -> None:
        """Register every D worker's lanes again every LANE_REFRESH_S (the service's
        registrations expire: a killed P never unregisters)."""
        if self.notifier is None:
            return
        for peer in self.peers.values():
            if now - peer.registered_at >= LANE_REFRESH_S:
                self.register_lanes(peer)

    def unregister_lanes(self, peer: Peer) -> None:
        """The worker pair is gone (D forgotten, P stopping): its lanes are no candidates."""
        h = peer.hello
        if self.notifier is not None and self.cfg.fabric_host and h.fabric_host:
            self.notifier.unregister_lanes(self.cfg.fabric_host, h.fabric_host, pair=self.worker_pair(h))
