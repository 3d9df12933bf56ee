"""P's control channel: the ZMQ ROUTER socket D workers talk to (the side channel).

This part owns the socket, its monitor and its CURVE context. It checks each message's
framing, version and binding (the routing id made for the key that authenticated it, the
agent it names) and yields the rest; it sends ``Welcome``, ``Ack`` and ``Pending``.
What a message means is decided by :mod:`~kvpath.connector.lane_setup` (Hello) and
:mod:`~kvpath.connector.flow_matching` (Register, Cancel). Writer thread only.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpath.connector import messages as M
from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.control_auth import ControlKeys, CurveServer, harden, names_agent, routing_id_matches
from kvpath.connector.telemetry import Stats

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_STEP = 256


class ControlChannel:
    """The ROUTER socket and what goes in and out of it."""

    def __init__(self, cfg: KVPathConfig, ctx: zmq.Context, stats: Stats, instance: str, address: str):
        self.cfg = cfg
        self.stats = stats
        self.instance = instance  # P's process, named in every Welcome and Ack
        self.address = address
        self._ctx = ctx
        self.router: Any = None  # the ROUTER socket, once open
        self.monitor: Any = None  # its disconnect monitor
        self._curve: CurveServer | None = None  # the CURVE context (keys given)
        self.public_key: bytes | None = None  # P's CURVE public key (z85), D's server key for us

    def open(self) -> tuple[zmq.Socket, zmq.Socket]:
        """Bind the socket; returns (its monitor, the socket): the thread closes both, the
        monitor first."""
        self.cfg.validate_security()
        if self.cfg.control_key:
            keys = ControlKeys.load(self.cfg.control_key, self.cfg.control_trusted_keys or "")
            self.public_key = keys.public
            self._curve = CurveServer(keys, on_denied=lambda: self.stats.inc("peers_refused"))
            self.router = self._curve.socket(zmq.ROUTER)
        else:  # control_plaintext, loopback only (validated)
            self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # D keeps its routing id across a reconnect, so P's answers to registrations held
        # across the break still reach D. When D reconnects before P has dropped the old
        # connection (a heartbeat timeout on a starved core), a ROUTER without handover
        # parks the new one for good: all D sends on it is lost while its heartbeats make
        # it look alive. With handover the newest connection takes the id. Another peer
        # cannot claim it without the id's random bytes, which travel only inside D's
        # encrypted handshake, and what it sends is dropped anyway (the id names D's key).
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        harden(self.router, self.cfg.control_max_message_bytes)
        # libzmq drops a peer's connection without telling us why (an oversized frame, a
        # peer that closed, heartbeats that stopped): the monitor counts those drops
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            self.router.bind(f"tcp://{self.address}")
        except zmq.ZMQError as e:
            # nobody will call close() on a writer that failed to start: free what it holds
            for s in (self.monitor, self.router):
                s.close(0)
            self.close()
            raise ConfigError(
                f"kv_connector_extra_config.side_channel_port: cannot listen on {self.address}: {e}"
            ) from e
        return self.monitor, self.router

    def close(self) -> None:
        """Release the CURVE context (after the sockets are closed: ctx.term waits for them)."""
        if self._curve is not None:
            self._curve.close()
            self._curve = None

    def receive(self) -> Iterator[tuple[bytes, Any]]:
        """The waiting messages, checked: (D's routing id, Hello | Register | Cancel).
        At most MAX_MESSAGES_PER_STEP per call: a flood must not starve pushes,
        heartbeats and acks."""
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
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
                self.send(ident, M.Welcome(self.instance, False, "protocol", str(e)))
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
            yield ident, msg

    def drain_monitor(self) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError, IndexError):  # a short or odd event: nothing to count
                continue
            self.stats.inc("control_disconnects")

    def ack(self, ident: bytes, tid: str, status: str, detail: str = "", posted: bool = False, nbytes: int = 0) -> None:
        self.send(ident, M.Ack(tid, status, detail, posted, bytes=nbytes, instance=self.instance))

    def send(self, ident: bytes, msg: Any) -> None:
        try:
            self.router.send_multipart([ident, M.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a gone peer: its own deadlines end its requests
            logger.debug("%s to a gone peer dropped: %s", type(msg).__name__, e)
