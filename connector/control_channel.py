"""P's control channel: the ZMQ ROUTER socket D workers talk to (the side channel).

Messages in: ``Hello`` (handed to lane set-up), ``Register`` and ``Cancel``; messages
out: ``Welcome``, ``Ack`` and ``Pending`` heartbeats. Every method runs on the writer
thread, which owns the socket (see :class:`kvpath.connector.sender.PushSender`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpath.connector import messages as M
from kvpath.connector.config import ConfigError
from kvpath.connector.control_auth import ControlKeys, CurveServer, harden, names_agent, routing_id_matches
from kvpath.connector.push_state import MAX_WAITING_PER_PEER, MAX_WAITING_REGISTRATIONS, FinishedPrefill, flow_key
from kvpath.connector.tp_map import d_ranks_of
from kvpath.trace import TransferRecord

if TYPE_CHECKING:
    from kvpath.connector.sender import PushSender

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_STEP = 256


class ControlChannel:
    """The side-channel half of :class:`~kvpath.connector.sender.PushSender` (a mixin:
    the state is the sender's, this groups the code that reads and writes the socket)."""

    def _open_router(self: "PushSender") -> None:
        self.cfg.validate_security()
        if self.cfg.control_key:
            keys = ControlKeys.load(self.cfg.control_key, self.cfg.control_trusted_keys or "")
            self.public_key = keys.public
            self._curve = CurveServer(keys, on_denied=lambda: self.stats.inc("peers_refused"))
            self._router = self._curve.socket(zmq.ROUTER)
        else:  # control_plaintext, loopback only (validated)
            self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # D keeps its routing id across a reconnect, so P's answers to registrations held
        # across the break still reach D. No ROUTER_HANDOVER: a second connection can
        # never take a live one's id (heartbeats drop a half-open one within seconds).
        harden(self._router, self.cfg.control_max_message_bytes)
        self._sockets.append(self._router)
        # libzmq drops a peer's connection without telling us why (an oversized frame, a
        # peer that closed, heartbeats that stopped): the monitor counts those drops
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sockets.insert(0, self._monitor)  # closed before the router
        try:
            self._router.bind(f"tcp://{self.address}")
        except zmq.ZMQError as e:
            # nobody will call close() on a writer that failed to start: free what it holds
            for s in (self._monitor, self._router):
                self._sockets.remove(s)
                s.close(0)
            if self._curve is not None:
                self._curve.close()
                self._curve = None
            raise ConfigError(
                f"kv_connector_extra_config.side_channel_port: cannot listen on {self.address}: {e}"
            ) from e

    def _drain_router(self: "PushSender") -> None:
        # at most this many per step: a flood must not starve pushes, heartbeats and acks
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed control message (%d frames)", len(frames))
                continue
            ident, data = frames[0].bytes, frames[1].bytes
            # the key that authenticated the sender (CURVE; None in loopback plaintext)
            user = frames[1].get("User-Id").encode() if self._curve is not None else None
            try:
                msg = M.decode_to_prefill(data)
            except M.WrongVersion as e:
                self.stats.inc("handshakes_refused")
                logger.warning("refused a Hello: %s", e)
                self._send(ident, M.Welcome(self.instance, False, "protocol", str(e)))
                continue
            except M.MalformedMessage as e:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed control message: %s", e)
                continue
            agent = msg.agent_name if isinstance(msg, (M.Hello, M.Register)) else None
            if not routing_id_matches(ident, user) or (agent is not None and not names_agent(ident, agent)):
                # a routing id made for another key, or a message about another D's agent
                self.stats.inc("messages_unbound")
                logger.warning("dropped a %s whose sender is not the agent or key it names", type(msg).__name__)
                continue
            if isinstance(msg, M.Cancel):
                self._on_cancel(ident, msg.transfer_id)
            elif isinstance(msg, M.Hello):
                self._on_hello(ident, msg)
            else:
                self._on_register(ident, msg)

    def _drain_monitor(self: "PushSender") -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError, IndexError):  # a short or odd event: nothing to count
                continue
            self.stats.inc("control_disconnects")

    def _on_register(self: "PushSender", ident: bytes, reg: M.Register) -> None:
        self.stats.inc("registrations")
        tid = reg.transfer_id
        peer = self._peers.get(reg.agent_name)
        if peer is None:  # no handshake with this D (P restarted since): D says Hello again
            self._ack(ident, tid, "unknown_peer", "no handshake with this D worker")
            return
        if peer.ident != ident:  # the agent's handshake came over another key's connection
            self.stats.inc("messages_unbound")
            logger.warning("dropped a registration for agent %s from another connection", reg.agent_name)
            return
        peer.last_seen = time.monotonic()
        bad = [b for b in reg.block_ids if b >= peer.hello.layout.num_blocks]
        if bad:
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", f"block id {bad[0]} outside D's {peer.hello.layout.num_blocks} blocks")
            return
        if reg.skip_blocks + len(reg.block_ids) > peer.hello.layout.num_blocks:
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", f"skip_blocks {reg.skip_blocks} + {len(reg.block_ids)} blocks exceed "
                                              f"D's {peer.hello.layout.num_blocks} blocks")
            return
        over = self._over_limit(ident, len(reg.block_ids), peer.hello.layout.num_blocks)
        if over:
            self.stats.inc("registrations_rejected")
            self.stats.inc("registrations_over_limit")
            logger.warning("registration of transfer %s from %s refused: %s", tid, reg.agent_name, over)
            self._ack(ident, tid, "rejected", over)
            return
        want_tp = reg.p_tp_size or peer.hello.compat.tp_size
        if want_tp != self.compat.tp_size:
            # D chose which P ranks to register with for another TP size: the heads it
            # expects from this rank are not the ones this rank holds
            self.stats.inc("registrations_rejected")
            why = (f"p_tp_size: D chose its P ranks for P TP={want_tp}, this P has TP={self.compat.tp_size}; give D "
                   f"P's TP size (kvpath.tp_size in the D leg's kv_transfer_params, the proxy's tp= field of --prefill)")
            logger.warning("registration of transfer %s rejected: %s", tid, why)
            self._ack(ident, tid, "rejected", why)
            return
        # D's deadlines, moved onto this clock. The message's age (wall clocks) is
        # taken off, so a Register that sat in a queue gets no extra time.
        now = time.monotonic()
        age = max(0.0, time.time() - reg.sent_at) if reg.sent_at else 0.0
        post_by = now + reg.post_by_s - age
        if post_by <= now:
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "expired", f"registration arrived {age:.1f}s after it was sent")
            return
        try:
            fan = d_ranks_of(self.compat.tp_size, self.compat.tp_rank, peer.hello.compat.tp_size,
                             self.compat.kv_heads)
        except ValueError:  # sizes the handshake would have refused
            fan = ()
        d_rank = peer.hello.compat.tp_rank
        if d_rank not in fan:  # D chose this P rank for heads it does not write to that D rank
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", f"P rank {self.compat.tp_rank} writes nothing to D rank {d_rank} "
                                              f"(P TP={self.compat.tp_size}, D TP={peer.hello.compat.tp_size})")
            return
        d_tp = peer.hello.compat.tp_size
        key = flow_key(tid, d_rank, len(fan), d_tp)
        siblings = tuple(flow_key(tid, d, len(fan), d_tp) for d in fan)
        status, m = self.state.add_registration(reg, ident, post_by, key, siblings)
        for fp in self.state.take_refused():
            self._refuse_prefill(fp)
        if status == "duplicate":
            self.stats.inc("registrations_duplicate")
            logger.warning("registration of %s for transfer %s rejected: the transfer id is taken (state %s)",
                           reg.request_id, tid, self.state.status_of(key) or "pending")
            self._ack(ident, tid, "rejected", "transfer id already registered by another request")
            return
        if status == "aborted":
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", "prefill request was aborted")
            return
        if status == "key_mismatch":
            self._refuse_key(ident, tid)
            return
        self._ack(ident, tid, "accepted")
        if m is not None:
            self._start_matched(m)

    def _over_limit(self: "PushSender", ident: bytes, blocks: int, num_blocks: int) -> str:
        """Why one more waiting registration of ``blocks`` block ids from ``ident`` would
        pass a bound ("" when it fits): P holds each until its prefill, D's post_by or a
        Cancel, so a peer must not be able to make P hold without end."""
        held, held_blocks = self.state.waiting_of(ident)
        if held >= MAX_WAITING_PER_PEER:
            return f"registrations: {held} of this D worker wait already (at most {MAX_WAITING_PER_PEER})"
        if len(self.state.registrations) >= MAX_WAITING_REGISTRATIONS:
            return f"registrations: {MAX_WAITING_REGISTRATIONS} wait already (P's bound over all D workers)"
        if held_blocks + blocks > num_blocks:
            return (f"block_ids: this D worker's waiting registrations would name {held_blocks + blocks} blocks, "
                    f"more than its {num_blocks}")
        return ""

    def _flow_of(self: "PushSender", ident: bytes, tid: str) -> str:
        """The key of the flow of ``tid`` that the D worker behind ``ident`` registers."""
        peer = next((p for p in self._peers.values() if p.ident == ident), None)
        if peer is None:
            return tid
        c = peer.hello.compat
        try:
            fan = d_ranks_of(self.compat.tp_size, self.compat.tp_rank, c.tp_size, self.compat.kv_heads)
        except ValueError:  # sizes the handshake refused
            return tid
        return flow_key(tid, c.tp_rank, len(fan), c.tp_size) if c.tp_rank in fan else tid

    def _on_cancel(self: "PushSender", ident: bytes, tid: str) -> None:
        key = self._flow_of(ident, tid)
        holder = self.state.registered_by(key)
        if holder is not None and holder != ident:  # only the D that registered it may cancel it
            self.stats.inc("messages_unbound")
            logger.warning("dropped a Cancel of transfer %s from a D that did not register it", tid)
            return
        status, fp, _ = self.state.cancel(key, ident)
        if status == "in_flight":
            self._cancel_parked(key)  # one waiting for a lane has posted nothing: it ends now
            return  # else D hears the completion notification or a failure
        if status == "unregistered":  # this sender has nothing to cancel: nothing is touched
            self._ack(ident, tid, "cancelled", "not registered", False)
            return
        if fp is not None:
            self._release(fp)
            self.stats.inc("pushes_cancelled")
            self._record(TransferRecord(tid, fp.request_id, status="cancelled", prefill_done_at=fp.finished_at))
        # A transfer that had ended is answered with its record (a posted WRITE stays
        # posted: D keeps its fence); one this process never saw is now recorded as
        # cancelled, and D weighs that answer by our instance.
        final, posted = self.state.final(key) or ("cancelled", False)
        self._ack(ident, tid, final, "already ended" if status == "done" else "", posted)

    def _refuse_key(self: "PushSender", ident: bytes, tid: str) -> None:
        """A registration without the transfer's key (someone who learned only its id)."""
        self.stats.inc("registrations_rejected")
        self.stats.inc("transfer_key_mismatch")
        logger.warning("registration of transfer %s refused: it does not carry the transfer's key", tid)
        self._ack(ident, tid, "rejected", "the registration does not carry the transfer's key")

    def _refuse_prefill(self: "PushSender", fp: FinishedPrefill) -> None:
        """A P request without a transfer key named a transfer whose registration carries
        one: its KV goes nowhere (never into that D's blocks) and its blocks are freed."""
        self.stats.inc("transfer_key_mismatch")
        self.stats.inc("prefills_refused")
        logger.warning("request %s names transfer %s without its key: its KV is not pushed, its blocks are freed",
                       fp.request_id, fp.transfer_id)
        self._release(fp)
        self._record(TransferRecord(fp.transfer_id, fp.request_id, status="rejected", prefill_done_at=fp.finished_at,
                                    detail="the request does not carry the transfer's key"))

    def _heartbeat(self: "PushSender") -> None:
        """Tell each D that P still holds its registrations (so D's clock measures
        P's liveness, not P's queue)."""
        by_ident: dict[bytes, list[str]] = {}
        for pr in self.state.held_registrations():
            by_ident.setdefault(pr.reply_to, []).append(pr.reg.transfer_id)
        for ident, tids in by_ident.items():
            self._send(ident, M.Pending(tids))
        beat = min((p.hello.heartbeat_s for p in self._peers.values()), default=1.0)
        self._next_heartbeat = time.monotonic() + beat

    def _ack(self: "PushSender", ident: bytes, tid: str, status: str, detail: str = "", posted: bool = False) -> None:
        self._send(ident, M.Ack(tid, status, detail, posted, instance=self.instance))

    def _send(self: "PushSender", ident: bytes, msg: Any) -> None:
        try:
            self._router.send_multipart([ident, M.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a gone peer: its own deadlines end its requests
            logger.debug("%s to a gone peer dropped: %s", type(msg).__name__, e)
