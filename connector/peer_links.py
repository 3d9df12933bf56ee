"""D's control connections to its P peers (one DEALER each): made on the first request
to a peer, dropped when they hold nothing and were idle for peer_idle_timeout_s, and
bounded in number. A part of :class:`~kvpath.connector.receiver.PushReceiver` that owns
the links, their sockets and monitors (receiver thread only); what goes over them is
the receiver's."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.control_auth import ControlKeys, harden, routing_id, secure_client
from kvpath.connector.peer_names import PeerNames
from kvpath.connector.telemetry import Stats

logger = logging.getLogger(__name__)

# P addresses one D worker keeps a connection to at once: a request naming a new one
# beyond it (after idle links are dropped) fails at once.
MAX_LINKS = 1024


@dataclass
class PeerLink:
    addr: str
    sock: zmq.Socket
    welcomed: bool = False
    instance: str = ""
    hello_at: float = 0.0
    refused_until: float = 0.0
    refusal: str = ""
    queued: list[M.Register] = field(default_factory=list)
    server_key: bytes | None = None  # P's CURVE public key (None: loopback plaintext)
    # P's lane connections into us, (source ip, port), per P process (instance), as
    # its Welcomes listed them: the fence watches them to tell when P's bytes can no
    # longer arrive.
    lanes: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    # P processes (instances) one of whose Welcomes said it could not list every lane
    # (a lane whose 5-tuple P could not learn): their fence is the time bound
    incomplete: set[str] = field(default_factory=set)
    # the lanes the current P process's last Welcome listed (each lists them all): what
    # the fence may attribute to a live P; lanes of processes gone are not (their
    # addresses may be reused by an unannounced lane)
    current_lanes: set[tuple[str, int]] = field(default_factory=set)
    # NIXL names of P's agents, per P process, as its Welcomes listed them: a push's
    # notification counts only from an agent of the process its registration went to.
    agents: dict[str, set[str]] = field(default_factory=dict)
    used_at: float = field(default_factory=time.monotonic)  # last request for it, or message from it
    # The connection's ZMTP handshake succeeded and it has not dropped since. With ZMTP
    # heartbeats (control_auth.harden) libzmq drops a connection whose peer's I/O thread
    # has not answered for HEARTBEAT_TIMEOUT_MS: up means P's process is alive and
    # reachable, even while its Python threads wait for a saturated core.
    up: bool = False
    # connections made so far (handshakes): a flow is held only on the connection P last
    # spoke about it on; a message lost with a dropped connection is not waited for
    epoch: int = 0
    monitor: zmq.Socket | None = None

# what a link's monitor reports: its connection proven (handshake) or gone. Not
# EVENT_CLOSED: each failed reconnect to an unreachable P fires it, ten times a second,
# and an established connection's end is DISCONNECTED anyway.
LINK_DOWN = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | LINK_DOWN


class PeerLinks:
    """The links by P address, with the sockets they hold."""

    def __init__(self, cfg: KVPathConfig, ctx: zmq.Context, stats: Stats, keys: ControlKeys | None,
                 sockets: list[zmq.Socket], *, on_unsent: Callable[[M.Register, str, str], None],
                 busy: Callable[[], set[str]]):
        """``sockets``: the thread's list of sockets to close (a link's are added and
        removed); ``on_unsent(reg, why, addr)``: a queued registration will never be sent;
        ``busy()``: P addresses a request waits on (their links are kept)."""
        self.cfg, self.stats = cfg, stats
        self._ctx, self._keys, self._sockets = ctx, keys, sockets
        self._on_unsent, self._busy = on_unsent, busy
        # keyed by one spelling of each P address (PeerNames): two links to one P would take
        # the routing id from each other
        self.by_addr: dict[str, PeerLink] = {}
        self.names = PeerNames(linked=lambda ip: any(addr.rpartition(":")[0] == ip for addr in self.by_addr))
        self._monitors: dict[zmq.Socket, PeerLink] = {}  # each link's monitor -> the link
        self._routing_id: bytes | None = None  # made with the first link (it names our NIXL agent)
        self.poller: zmq.Poller | None = None  # the receiver thread's, set when it runs
        self.agent_name = ""  # our NIXL agent's name, set at start

    def get(self, peer: str) -> PeerLink | None:
        return self.by_addr.get(peer)

    def __contains__(self, peer: str) -> bool:
        return peer in self.by_addr

    def __iter__(self) -> Iterator[PeerLink]:
        return iter(list(self.by_addr.values()))

    def __len__(self) -> int:
        return len(self.by_addr)

    def agents(self, peer: str, instance: str) -> set[str]:
        """NIXL names of the agents P process ``instance`` at ``peer`` listed."""
        link = self.by_addr.get(peer)
        return link.agents.get(instance, set()) if link is not None else set()

    def lanes_announced(self, but: PeerLink | None, instance: str) -> set[tuple[str, int]]:
        """The lanes live P processes announced last, but ``instance``'s at ``but``."""
        return {lane for lk in self.by_addr.values() if not (lk is but and lk.instance == instance)
                for lane in lk.current_lanes}

    def reconnect_all(self) -> None:
        for link in self.by_addr.values():
            link.sock.disconnect(f"tcp://{link.addr}")
            link.sock.connect(f"tcp://{link.addr}")

    def on_events(self, events: dict) -> None:
        """Follow the links whose monitor has news."""
        for sock in events:
            link = self._monitors.get(sock)
            if link is not None:
                self.drain_monitor(link)
    def link(self, peer: str, server_key: bytes | None) -> PeerLink | None:
        """The control connection to ``peer``; None when it is known by another key."""
        link = self.by_addr.get(peer)
        if link is not None and link.server_key != server_key:
            if link.instance:  # that key answered: P at this address holds it
                return None
            # never welcomed: the other key may be the wrong one; the newest request decides
            self.drop(link, "P's key changed before its handshake completed")
            link = None
        if link is None:
            if len(self.by_addr) >= MAX_LINKS:
                self.prune(time.monotonic(), need_room=True)
                if len(self.by_addr) >= MAX_LINKS:
                    return None
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            harden(s, self.cfg.control_max_message_bytes)
            # One id for all of this process's links, bound to our key: after a broken
            # connection, or a link dropped while idle and made again, P knows us by it
            # (its handshake and registrations are bound to the id).
            if self._routing_id is None:
                self._routing_id = routing_id(self._keys.public if self._keys else None, self.agent_name)
            s.routing_id = self._routing_id
            if self._keys is not None and server_key is not None:
                secure_client(s, self._keys, server_key)
            try:
                mon = s.get_monitor_socket(LINK_EVENTS)  # before connect: its first handshake is seen
            except zmq.ZMQError as e:  # out of sockets or descriptors: this request fails cleanly
                logger.error("no control link to %s: %s", peer, e)
                s.close(0)
                return None
            s.connect(f"tcp://{peer}")
            link = self.by_addr[peer] = PeerLink(peer, s, server_key=server_key, monitor=mon)
            self._sockets += [mon, s]  # the monitor closes before its socket
            self._monitors[mon] = link
            assert self.poller is not None, "links are made on the receiver thread"
            self.poller.register(s, zmq.POLLIN)
            self.poller.register(mon, zmq.POLLIN)
        return link

    def drain_monitor(self, link: PeerLink) -> None:
        """Follow the control connection's state (``PeerLink.up``)."""
        assert link.monitor is not None
        while True:
            try:
                ev = recv_monitor_message(link.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError, IndexError):  # a closed or garbled monitor: not proven
                link.up = False
                return
            kind = ev.get("event")
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.up, link.epoch = True, link.epoch + 1
            elif kind is not None and kind & LINK_DOWN:
                link.up = False

    def transport_alive(self, peer: str) -> int | None:
        """The connection (epoch) by which P's process at ``peer`` is alive and reachable
        now, or None."""
        link = self.by_addr.get(peer)
        return None if link is None else self.epoch(link)

    def epoch(self, link: PeerLink) -> int | None:
        return link.epoch if link.up else None

    def drop(self, link: PeerLink, why: str) -> None:
        for reg in link.queued:
            self._on_unsent(reg, why, link.addr)
        link.queued.clear()
        if link.monitor is not None:
            self.poller.unregister(link.monitor)
            self._sockets.remove(link.monitor)
            self._monitors.pop(link.monitor, None)
            link.sock.disable_monitor()
            link.monitor.close(0)
        self.poller.unregister(link.sock)
        self._sockets.remove(link.sock)
        link.sock.close(0)
        del self.by_addr[link.addr]

    def prune(self, now: float, need_room: bool = False) -> None:
        """Drop links that hold nothing (no request waits on that P, nothing queued) and
        were idle for peer_idle_timeout_s, or whose Hello was never answered for two
        heartbeats; ``need_room``: also the least recently used idle one."""
        busy = self._busy()
        window = 2 * self.cfg.heartbeat_s()
        idle = sorted((link.used_at, addr) for addr, link in self.by_addr.items()
                      if addr not in busy and not link.queued)
        for used_at, addr in idle:
            link = self.by_addr[addr]
            unanswered = not link.welcomed and now - link.hello_at > window
            if now - used_at > self.cfg.peer_idle_timeout_s or unanswered:
                self.drop(link, "idle")
                self.stats.inc("peers_forgotten")
        if need_room and len(self.by_addr) >= MAX_LINKS:
            rest = [addr for _, addr in idle if addr in self.by_addr]
            if rest:
                self.drop(self.by_addr[rest[0]], "the least recently used, to make room")
                self.stats.inc("peers_forgotten")

    def handshaking(self, now: float) -> bool:
        """A Hello went out recently and P has not answered: P may be opening its lanes
        into us (a link that never gets an answer stops counting after two heartbeats)."""
        window = 2 * self.cfg.heartbeat_s()
        return any(not link.welcomed and now - link.hello_at < window for link in self.by_addr.values())

