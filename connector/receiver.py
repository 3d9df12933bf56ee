"""D side of the transfer engine: handshake and registrations out, acks and notifications in.

One thread owns the control sockets (one DEALER per P peer) and the NIXL agent
that exposes D's KV memory. It keeps UCX progressing while pushes are expected
(over TCP a target that does not progress stalls the initiator's WRITE).
The first contact with a P peer is a ``Hello`` (agent metadata, layout,
compatibility); registrations to that peer wait for its ``Welcome``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig, is_loopback, parse_host_port
from kvpath.connector.control_auth import ControlKeys
from kvpath.connector.engine_thread import DORMANT_POLL_MS, LINGER_S, EngineThread
from kvpath.connector.entropy import LISTEN_LOCK, listening_sockets
from kvpath.connector.peer_links import MAX_LINKS, PeerLink, PeerLinks
from kvpath.connector.peer_names import Unresolvable
from kvpath.connector.nixl_io import PROBE_BYTES, configure_ucx, make_agent
from kvpath.connector.recv_state import ReceiverState
from kvpath.connector.tcp_table import lanes_drained
from kvpath.connector.telemetry import Stats
from kvpath.trace import ReceivedRecord, TraceWriter

logger = logging.getLogger(__name__)

# A refused handshake is retried after this long (P may have been restarted, fixed).
REFUSAL_RETRY_S = 5.0


class PushReceiver(EngineThread):
    # every control link holds a DEALER and a monitor (two sockets and libzmq's inner one)
    CTX_MAX_SOCKETS = 3 * MAX_LINKS + 64

    def __init__(
        self,
        cfg: KVPathConfig,
        layout: M.BlockLayout,
        spans: list[tuple[int, int]],
        engine_id: str | None = None,
        rank: int = 0,
        stats: Stats | None = None,
        trace: TraceWriter | None = None,
        compat: M.Compat | None = None,
    ):
        super().__init__(cfg, layout, spans, engine_id, rank, stats, trace, "d", compat)
        self.state = ReceiverState(cfg.registration_timeout_s, cfg.max_wait_s, cfg.fence_grace_s,
                                   write_bound_s=cfg.transfer_timeout_s)
        self._lock = threading.Lock()  # guards self.state between threads
        self._next_prune = 0.0
        # (transfer id, P peer) -> its Register; receiver thread only: to re-send after P restarted
        self._regs: dict[tuple[str, str], M.Register] = {}
        # commands waiting for a host name's lookup (receiver thread only): at most one per
        # registration the engine made, each retried when a lookup answers
        self._parked: list[tuple[str, Any]] = []
        self.instance = uuid.uuid4().hex[:12]
        self._keys: ControlKeys | None = None
        cfg.validate_security()
        if cfg.control_key:
            self._keys = ControlKeys.load(cfg.control_key, cfg.control_trusted_keys or "")
        self.agent: Any = None
        self.links = PeerLinks(cfg, self._ctx, self.stats, self._keys, self._sockets, on_unsent=self._unsent,
                               busy=self._busy_peers)
        self._names_answered = threading.Event()
        self.links.names.on_answer = self._names_answer

    def start(self) -> "PushReceiver":
        try:
            configure_ucx(self.cfg)
            # UCX opens its listening socket when the agent is created: the new listening
            # ports are where P's lanes connect, so P can tell its lane's connection exactly.
            with LISTEN_LOCK:
                before = listening_sockets()
                self.agent = make_agent(f"{self.engine_id}-r{self.rank}-recv-{uuid.uuid4().hex[:6]}")
                self.listen_addrs = sorted(listening_sockets() - before)
                self.listen_ports = sorted({port for _, port in self.listen_addrs})
            self._register(self.agent, self.spans, self.layout.mem_type, self.layout.device_id)
            self._register(self.agent, [(self.probe.ctypes.data, PROBE_BYTES)], "DRAM")
            self.metadata = self.agent.get_agent_metadata()
            self.links.agent_name = self.agent.name
            self._start_thread(self._run, "kvpath-push-receiver")
        except BaseException:
            self.close()  # nobody closes a receiver that failed to start (see PushSender.start)
            raise
        return self

    def _drop_agents(self) -> None:
        self.agent = None  # NIXL's agent object releases its UCX worker when collected

    # -- engine thread ----------------------------------------------------------
    def register(self, request_id: str, transfer_id: str, peer: str | list[str], block_ids: list[int],
                 skip_blocks: int = 0, peer_key: str | None = None, transfer_key: str = "",
                 p_tp_size: int = 0, peer_ranks: list[int] | None = None) -> None:
        """Ask P at ``peer`` (host:port; several: the P ranks that write into this rank,
        one flow each) to push ``transfer_id`` into ``block_ids``.
        ``peer_key``: P's public key (z85), needed when D trusts more than one;
        ``transfer_key``: the transfer's secret, when the request carries one;
        ``p_tp_size``: the P TP size these peers were chosen for (P checks it);
        ``peer_ranks``: their P ranks, for the trace."""
        peers = [peer] if isinstance(peer, str) else list(dict.fromkeys(peer))
        for p in peers:
            parse_host_port(p, "kv_transfer_params.kvpath.peer")
        server_key, why = self._server_key(peers[0], peer_key) if peers else (None, "no P peer to register with")
        if why:
            # a peer this engine's own config does not trust: nothing is sent to it
            with self._lock:
                self.state.reject_new(request_id)
            self.stats.inc("peers_untrusted")
            logger.error("request %s not registered with %s: %s", request_id, peer, why)
            return
        with self._lock:
            if self.state.waits(request_id):
                # registered already (vLLM does not re-register a request): its flows end it
                self.stats.inc("registrations_duplicate")
                logger.warning("request %s is registered already: the second registration is ignored", request_id)
                return
            serial = self.state.add(request_id, transfer_id, peers, peer_ranks)
            if not serial:
                # Two live requests with one transfer id (a reused id, or n > 1 whose
                # children share kv_transfer_params): only one can receive the push.
                self.state.reject_new(request_id)
                self.stats.inc("registrations_duplicate")
                logger.warning("request %s reuses transfer id %s, which another request is waiting on: failed",
                               request_id, transfer_id)
                return
        self.put("register", (request_id, transfer_id, peers, list(block_ids), skip_blocks, server_key, transfer_key,
                               p_tp_size, serial))

    def refuse(self, request_id: str, why: str) -> None:
        """Fail a request that cannot be registered (its KV cannot come): freed at once."""
        with self._lock:
            self.state.reject_new(request_id)
        self.stats.inc("recv_failed")
        logger.error("request %s not registered: %s", request_id, why)
        self._wake()

    def connect(self, peer: str, peer_key: str | None = None) -> None:
        """Handshake with P at ``peer`` now (P opens its lanes to us on our Hello), so the
        first request to it does not pay for that."""
        parse_host_port(peer, "peer")
        server_key, why = self._server_key(peer, peer_key)
        if why:
            raise ValueError(why)
        self.put("connect", (peer, server_key))

    def reconnect(self) -> None:
        """Close and re-open every control connection (as a broken TCP connection does). The
        routing id stays, so P's answers to held registrations still reach us."""
        self.put("reconnect", None)

    def _server_key(self, peer: str, peer_key: str | None) -> tuple[bytes | None, str]:
        """(P's CURVE key to use, why not) for a registration naming ``peer``: only a key
        in this engine's control_trusted_keys, whatever the request says."""
        if self._keys is None:  # control_plaintext: loopback peers only
            if not is_loopback(parse_host_port(peer)[0]):
                return None, f"control_plaintext talks to loopback peers only, not {peer}"
            return None, ""
        if peer_key:
            key = peer_key.encode()
            if key not in self._keys.trusted:
                return None, "kvpath.peer_key is not one of this engine's control_trusted_keys"
            return key, ""
        if len(self._keys.trusted) == 1:
            return next(iter(self._keys.trusted)), ""
        return None, (f"this engine trusts {len(self._keys.trusted)} prefill keys: "
                      "the request must name P's in kv_transfer_params.kvpath.peer_key")

    def cancel(self, request_id: str) -> None:
        """D's request ended while waiting: ask P not to push; release when safe."""
        with self._lock:
            self.state.cancel_request(request_id)
        self._wake()

    def take(self) -> tuple[set[str], set[str]]:
        """(released, failed): see :mod:`kvpath.connector.recv_state`."""
        with self._lock:
            return self.state.take()

    def has_results(self) -> bool:
        with self._lock:
            return bool(self.state.released)

    # -- receiver thread ----------------------------------------------------------
    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self.links.poller = self._poller
        self._next_expire = 0.0
        self.active_until = 0.0
        self._loop(self.step)

    def step(self) -> None:
        try:
            self.step_body()
        finally:  # also after an error mid-step: a release made before it is reported now
            with self._lock:
                ready = bool(self.state.released)
            if ready:
                self.results_ready.set()

    def step_body(self) -> None:
        with self._lock:
            need = self.state.progress_need()
            held = self.state.pending() > 0
        now = time.monotonic()
        if need == "idle" and self.links.handshaking(now):
            need = "fast"  # P probes its lanes into us now: each probe waits on our progress
        if held or need != "idle":
            self.active_until = now + LINGER_S
        # Over TCP a WRITE moves only while the target progresses UCX: while a posted
        # push should be moving, progress without pause (yielding the GIL); while one
        # is slow or a handshake's lane probes may come, every millisecond; while
        # something is held (P's control messages wake the poll), at the idle pace;
        # with nothing held for LINGER_S, at the dormant pace.
        spinning = need == "spin"
        if spinning:
            timeout_ms = 0
        elif need == "fast":
            timeout_ms = 1
        elif now < self.active_until:
            timeout_ms = int(self.cfg.idle_poll_s * 1000)
        else:
            timeout_ms = DORMANT_POLL_MS
        events = self.poll_events(timeout_ms)
        if events is None:
            return
        self.drain_commands()
        self.links.on_events(events)
        for link in self.links:
            if link.sock in events:
                self._drain_replies(link)
        self.poll_notifs()
        if spinning:
            burst_end = time.monotonic() + 0.001
            while time.monotonic() < burst_end:
                time.sleep(0.00005)  # hand the GIL (and the CPU) to the engine thread between calls
                self.poll_notifs()
        now = time.monotonic()
        if now >= self._next_expire:
            self._expire()
            self._next_expire = now + 0.05
        if now >= self._next_prune:
            self.links.prune(now)
            self._next_prune = now + 1.0
        self.send_cancels()

    def drain_commands(self) -> None:
        commands = list(self._commands())
        if self._parked and self._names_answered.is_set():
            # commands waiting for a host name's lookup, retried when one answers
            self._names_answered.clear()
            commands[:0], self._parked = self._parked, []
        for kind, arg in commands:
            try:
                if kind == "register":
                    self._register_request(arg)
                elif kind == "reconnect":
                    self.links.reconnect_all()
                elif kind == "connect":
                    self._connect(arg)
            except Exception:  # one command's fault must not lose the others taken from the queue
                self.stats.inc("engine_thread_errors")
                logger.exception("a %s command failed", kind)

    def _names_answer(self) -> None:
        """A host name's lookup answered (on its own thread): retry the parked commands."""
        self._names_answered.set()
        self._wake()

    def _connect(self, arg: tuple) -> None:
        peer, server_key = arg
        try:
            addr = self.links.names.canonical(peer)
        except Unresolvable as e:
            logger.error("no control link to %s: %s", peer, e)
            return
        if addr is None:
            self._parked.append(("connect", arg))
            return
        link = self.links.link(addr, server_key)
        if link is not None:
            self.flush(link)

    def _register_request(self, arg: tuple) -> None:
        request_id, tid, peers, block_ids, skip, server_key, transfer_key, p_tp, serial = arg
        with self._lock:
            # a flow ended while its command waited (a cancel, its deadline), or a later
            # registration took its ids: this command's blocks may be someone else's now
            peers = [p for p in peers if self.state.current(tid, p, serial)]
        spelled: list[tuple[str, str]] = []
        for given in peers:
            try:
                addr = self.links.names.canonical(given)
            except Unresolvable as e:
                with self._lock:
                    self.state.send_failed(tid, str(e), given, request_id)
                logger.error("request %s not registered with %s: %s", request_id, given, e)
                continue
            if addr is None:  # its lookup runs: nothing is sent (its flows are unsent: freeing them is safe)
                self._parked.append(("register", arg))
                return
            spelled.append((given, addr))
        for given, peer in spelled:  # one flow per P rank
            with self._lock:
                # renamed before anything is sent, so P's answers (which come on the link) find it
                renamed = self.state.rename_peer(tid, given, peer, serial)
                if not renamed:
                    self.state.send_failed(tid, f"{given} is {peer}, which the request names already", given,
                                           request_id)
            if not renamed:
                logger.error("request %s: P %s named twice (as %s)", request_id, peer, given)
                continue
            self._register_flow(request_id, tid, peer, server_key, M.Register(
                transfer_id=tid, request_id=request_id, agent_name=self.agent.name, block_ids=block_ids,
                skip_blocks=skip, post_by_s=self.cfg.max_wait_s, transfer_key=transfer_key,
                p_tp_size=p_tp,
            ))

    def _register_flow(self, request_id: str, tid: str, peer: str, server_key: bytes | None,
                       reg: M.Register) -> None:
        link = self.links.link(peer, server_key)
        if link is None:
            known = peer in self.links
            why = "P is known by another key" if known else f"{MAX_LINKS} P peers connected, none idle"
            with self._lock:
                self.state.send_failed(tid, why, peer, request_id)
            self.stats.inc("peers_untrusted" if known else "peers_over_limit")
            logger.error("request %s not registered with %s: %s", request_id, peer, why)
            return
        link.used_at = time.monotonic()
        self._regs[(tid, peer)] = reg
        link.queued.append(reg)
        self.flush(link)

    def flush(self, link: PeerLink) -> None:
        """Send what waits for ``link``: a Hello first, registrations once welcomed."""
        now = time.monotonic()
        if link.refused_until > now:
            self._fail_queued(link, link.refusal)
            return
        if not link.welcomed:
            if now - link.hello_at > self.cfg.heartbeat_s():  # (re)send until P answers
                link.hello_at = now
                self._send(link, M.Hello(
                    engine_id=self.engine_id, agent_name=self.agent.name, agent_metadata=self.metadata,
                    layout=self.layout, compat=self.compat, instance=self.instance,
                    heartbeat_s=self.cfg.heartbeat_s(), probe_addr=self.probe.ctypes.data, probe_len=PROBE_BYTES,
                    listen_ports=self.listen_ports, listen_addrs=self.listen_addrs, host=self.cfg.side_channel_host,
                    fabric_host=self.cfg.fabric_host or "",
                ))
            return
        queued, link.queued = link.queued, []
        for reg in queued:
            # Checked and marked sent in one step, before the send: an abort between
            # the two would otherwise release the blocks as never sent while the
            # Register is on its way to P.
            with self._lock:
                if not self.state.on_sent(reg.transfer_id, link.instance, link.addr, reg.request_id,
                                          epoch=self.links.epoch(link)):
                    continue  # given up while queued
            stamped = msgspec.structs.replace(reg, sent_at=time.time())
            if not self._send(link, stamped):  # not queued: P cannot know of it
                with self._lock:
                    self.state.send_failed(reg.transfer_id, "control channel full", link.addr, reg.request_id)

    def _send(self, link: PeerLink, msg: Any) -> bool:
        try:
            link.sock.send(M.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # queue full (P gone for long) or socket closed
            self.stats.inc("control_send_failed")
            logger.warning("cannot send %s to P at %s: %s", type(msg).__name__, link.addr, e)
            return False

    def _fail_queued(self, link: PeerLink, why: str) -> None:
        link.queued.clear()
        with self._lock:
            failed = self.state.fail_unsent(link.addr, why)
        for w in failed:
            self.stats.inc("recv_failed")
            logger.warning("request %s not registered with %s: %s", w.request_id, link.addr, why)

    def _drain_replies(self, link: PeerLink) -> None:
        while True:
            try:
                data = link.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            link.used_at = time.monotonic()
            try:
                msg = M.decode_to_decode(data)
            except M.MalformedMessage as e:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed message from %s: %s", link.addr, e)
                continue
            if isinstance(msg, M.Welcome):
                self.on_welcome(link, msg)
            elif isinstance(msg, M.Pending):
                with self._lock:
                    for tid in msg.transfer_ids:
                        self.state.on_alive(tid, link.addr, epoch=self.links.epoch(link))
            else:
                self.on_ack(link, msg)

    def on_welcome(self, link: PeerLink, msg: M.Welcome) -> None:
        if not msg.ok:
            link.welcomed = False
            link.refused_until = time.monotonic() + REFUSAL_RETRY_S
            # P's words, bounded and quoted: a peer's text must not forge log lines
            link.refusal = f"P at {link.addr} refused the handshake: {msg.detail[:512]!r}"
            self.stats.inc("handshakes_refused")
            logger.error("%s (field %r)", link.refusal, msg.field[:64])
            self._fail_queued(link, link.refusal)
            return
        if link.instance and msg.instance != link.instance:
            with self._lock:
                gone = self.state.peer_restarted(link.addr)
            self.stats.inc("peer_restarts")
            logger.warning("P at %s restarted (instance %s -> %s): %d waiting requests end once its old "
                           "connections are drained", link.addr, link.instance, msg.instance, len(gone))
        if msg.instance != link.instance:
            other = next((lk for lk in self.links if lk is not link and lk.instance == msg.instance), None)
            if other is not None:
                # one P process at two addresses: our links share one routing id, which P hands to
                # the newest connection, so each takes the other's answers (peer_names.py)
                self.stats.inc("peers_aliased")
                idle = other.addr not in self._busy_peers() and not other.queued
                logger.error("P at %s is the process D also reaches at %s (instance %s): name each P by one "
                             "address. %s", link.addr, other.addr, msg.instance,
                             f"The link to {other.addr} held nothing and is closed." if idle else
                             f"Requests waiting on {other.addr} may not arrive.")
                if idle:  # closing it ends the tug of war over the id (its next use makes it again)
                    self.links.drop(other, "the same P process is reached at another address")
        link.lanes.setdefault(msg.instance, set()).update((ip, port) for ip, port in msg.lanes)
        link.current_lanes = {(ip, port) for ip, port in msg.lanes}
        if not msg.complete:  # sticky: a lane it could not list may still be open
            link.incomplete.add(msg.instance)
        link.agents.setdefault(msg.instance, set()).update(msg.agents)
        link.instance, link.welcomed, link.refusal = msg.instance, True, ""
        self.flush(link)

    def on_ack(self, link: PeerLink, ack: M.Ack) -> None:
        if ack.status == "accepted":
            with self._lock:
                self.state.on_alive(ack.transfer_id, link.addr, epoch=self.links.epoch(link))
            return
        if ack.status == "posted":
            with self._lock:
                self.state.on_posted(ack.transfer_id, ack.bytes, peer=link.addr, epoch=self.links.epoch(link))
            return
        if ack.status == "unknown_peer":
            # P does not know us (it restarted): handshake again, then re-send.
            link.welcomed = False
            link.hello_at = 0.0
            with self._lock:
                w = self.state.on_unknown_peer(ack.transfer_id, link.addr)
            key = (ack.transfer_id, link.addr)
            if w is not None and not w.failed and key in self._regs:
                link.queued.append(self._regs[key])
            self.flush(link)
            return
        with self._lock:
            outcome, w = self.state.on_ended(ack.transfer_id, ack.posted, f"{ack.status}: {ack.detail}",
                                             instance=ack.instance, peer=link.addr)
        if outcome == "ignored":
            # Another P process's answer (P restarted), or "never posted" after a
            # posted WRITE: it proves nothing about bytes still on the way.
            self.stats.inc("acks_ignored")
            logger.info("ignored %s (posted=%s) for transfer %s from P process %r (registration sent to %r)",
                        ack.status, ack.posted, ack.transfer_id, ack.instance, w.instance if w else "")
        elif w is not None and not w.cancelled:
            self.stats.inc("recv_failed")
            logger.warning("push for %s ended as %s: %s", w.request_id, ack.status, ack.detail)

    def send_cancels(self) -> None:
        with self._lock:
            todo = self.state.to_cancel()  # counts them sent and schedules the re-send
        for w in todo:
            link = self.links.get(w.peer)
            if link is not None:
                self._send(link, M.Cancel(w.transfer_id))

    def drained(self, peer: str, instance: str) -> bool | None:
        """Every lane connection of the P process ``instance`` at ``peer`` into us is
        closed and fully read. None: we cannot tell (the state's bound decides): we know
        none of its lanes, its Welcome said the list is incomplete, or a connection into
        our UCX ports that no P announced is still open (a reopened lane whose Welcome
        was lost, or NAT rewriting P's addresses: it may be this P's)."""
        link = self.links.get(peer)
        lanes = link.lanes.get(instance, set()) if link is not None else set()
        if link is None or not lanes or instance in link.incomplete:
            return None
        # lanes live P processes announced last (not the fenced process's own: its are
        # ``lanes``): an open connection from any of those is another P's
        announced = lanes | self.links.lanes_announced(link, instance)
        return lanes_drained(set(self.listen_ports), lanes, announced)

    def _expire(self) -> None:
        # The socket table is read outside the lock (the engine thread takes it every
        # step) and once per P process that has requests fenced, not once per request.
        with self._lock:
            fenced = {(w.peer, w.instance) for w in self.state.fencing()}
        drained = {key: self.drained(*key) for key in fenced}
        with self._lock:
            holds = self.state.transport_holds
            # not asked yet (newly given up): "not drained", asked next time
            gave_up, released = self.state.expire(lambda peer, instance: drained.get((peer, instance), False),
                                                  self.links.transport_alive)
            held = self.state.transport_holds - holds
        if held:
            self.stats.inc("liveness_held_by_transport", held)
        for w in gave_up:
            if w.cancelled:
                continue
            self.stats.inc("recv_timeout")
            logger.warning(
                "no push for request %s (transfer %s) from %s: %s; cancelling it (blocks held until no WRITE can land)",
                w.request_id, w.transfer_id, w.peer, w.why,
            )
        for w in released:
            if w.released_by == "bound":
                self.stats.inc("fence_bound_releases")
                logger.warning("blocks of %s released: P's lane connections are unknown, and max_wait_s + "
                               "transfer_timeout_s + fence_grace_s passed since the registration", w.request_id)
                continue
            self.stats.inc("fence_drain_releases")
            logger.info("blocks of %s released: P's connections to us are closed and drained", w.request_id)
        for link in self.links:
            if link.queued:
                self.flush(link)
        with self._lock:
            live = {(w.transfer_id, w.peer, w.request_id) for w in self.state.waiting() if not w.sent}
            live_keys = {(w.transfer_id, w.peer) for w in self.state.waiting()}
        for key in [k for k in self._regs if k not in live_keys]:
            del self._regs[key]
        for link in self.links:  # a flow that ended while its Register waited: never sent
            link.queued = [r for r in link.queued if (r.transfer_id, link.addr, r.request_id) in live]

    def _dump_copy(self, w: Any) -> Any:
        reg = self._regs.get((w.transfer_id, w.peer))
        if reg is None or self.kv_dump is None or self.state.failing(w.request_id):
            return None
        return self.kv_dump.copy(w.transfer_id, self.layout, self.compat, reg.block_ids, reg.skip_blocks)

    def _unsent(self, reg: M.Register, why: str, addr: str) -> None:
        """A dropped link's queued registration: its flow fails, never sent."""
        with self._lock:
            self.state.send_failed(reg.transfer_id, why, addr, reg.request_id)

    def _busy_peers(self) -> set[str]:
        with self._lock:
            return {w.peer for w in self.state.waiting()}

    def _verify(self, tid: str, sender: str, raw_check: bytes | None) -> str:
        """kv_verify: "" when the push is not checked or checks out, else why it failed."""
        if self.kv_verify is None or not self.kv_verify.selected(tid):
            return ""
        with self._lock:
            w = self.state.done_flow(tid, sender, self.links.agents)
        if w is None:
            return ""  # stray: the caller drops it
        reg = self._regs.get((tid, w.peer))
        return self.kv_verify.check_landed(tid, w, reg, raw_check, self.layout, self.compat, self.stats)

    def poll_notifs(self) -> None:
        notifs = self.agent.get_new_notifs()
        for sender, msgs in notifs.items():  # keyed by the sending agent's NIXL name
            for raw in msgs:
                parsed = M.split_notif(raw)
                if parsed is None:
                    continue
                tid, check = parsed
                # kv_verify: hashed before the flow ends (the blocks are still the request's)
                bad = self._verify(tid, sender, check)
                copied = None
                with self._lock:
                    w = self.state.on_done(tid, sender, self.links.agents, bad)
                    if w is not None and self.kv_dump is not None and tid not in self.state.by_tid:
                        # every flow of it into this rank has landed; copied under the lock, so
                        # the engine cannot take the release (and reuse the blocks) first
                        copied = self._dump_copy(w)
                if copied is not None:
                    self.kv_dump.save(copied)  # the disk write, outside the lock
                if w is None:
                    # No registration waits for it, or it comes from an agent of another
                    # process than the one the registration went to: never a success.
                    self.stats.inc("notifs_stray")
                    logger.warning("dropped notification for transfer %s from agent %s", tid, sender)
                    continue
                if bad:
                    self.stats.inc("kv_verify_mismatch")
                    self.stats.inc("recv_failed")
                    logger.error("%s: request %s fails", bad, w.request_id)
                elif not w.failed:
                    self.stats.inc("recv_ok")
                    # when the last byte is here: the push's end as D sees it
                    self.record(ReceivedRecord(transfer_id=tid, request_id=w.request_id, engine=self.engine_id,
                                                at=time.time(), peer_rank=w.peer_rank))
