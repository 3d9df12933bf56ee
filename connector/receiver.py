"""D side of the transfer engine: registrations out, notifications in.

One thread owns the control sockets (one DEALER per P peer) and the NIXL agent
that exposes D's KV memory. It keeps UCX progressing while pushes are expected
(over TCP a target that does not progress stalls the initiator's WRITE).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import zmq

from connector import messages as M
from connector.config import KVPathConfig, parse_host_port
from connector.engine_thread import EngineThread
from connector.nixl_io import PROBE_BYTES, configure_ucx, make_agent, register
from connector.recv_state import ReceiverState
from connector.telemetry import Stats, TraceWriter

logger = logging.getLogger(__name__)


class PushReceiver(EngineThread):
    def __init__(
        self,
        cfg: KVPathConfig,
        layout: M.BlockLayout,
        spans: list[tuple[int, int]],
        engine_id: str | None = None,
        rank: int = 0,
        stats: Stats | None = None,
        trace: TraceWriter | None = None,
    ):
        super().__init__(cfg, layout, spans, engine_id, rank, stats, trace, "d")
        self.state = ReceiverState(cfg.registration_timeout_s)
        self._lock = threading.Lock()  # guards self.state between threads
        self._socks: dict[str, zmq.Socket] = {}
        self.agent: Any = None

    def start(self) -> "PushReceiver":
        configure_ucx(self.cfg)
        self.agent = make_agent(f"{self.engine_id}-r{self.rank}-recv-{uuid.uuid4().hex[:6]}")
        register(self.agent, self.spans, self.layout.mem_type, self.layout.device_id)
        register(self.agent, [(self._probe.ctypes.data, PROBE_BYTES)], "DRAM")
        self.metadata = self.agent.get_agent_metadata()
        self._start_thread(self._run, "kvpath-push-receiver")
        return self

    # -- engine thread ----------------------------------------------------------
    def register(self, request_id: str, transfer_id: str, peer: str, block_ids: list[int], skip_blocks: int = 0) -> None:
        """Ask P at ``peer`` (host:port) to push ``transfer_id`` into ``block_ids``."""
        parse_host_port(peer, "kv_transfer_params.kvpath.peer")
        with self._lock:
            if not self.state.add(request_id, transfer_id, peer):
                logger.warning("transfer %s registered twice; second registration ignored", transfer_id)
                return
        self._put("register", (request_id, transfer_id, peer, list(block_ids), skip_blocks))

    def cancel(self, request_id: str) -> None:
        """D's request ended while waiting: ask P not to push; release when safe."""
        with self._lock:
            w = self.state.cancel_request(request_id)
        if w is not None:
            self._put("cancel", (w.transfer_id, w.peer))

    def take(self) -> tuple[set[str], set[str]]:
        with self._lock:
            return self.state.take()

    def pending(self) -> int:
        with self._lock:
            return self.state.pending()

    # -- receiver thread ----------------------------------------------------------
    def _sock(self, peer: str) -> zmq.Socket:
        s = self._socks.get(peer)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{peer}")
            self._socks[peer] = s
            self._sockets.append(s)
            self._poller.register(s, zmq.POLLIN)
        return s

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        next_expire = 0.0
        while not self._stop.is_set():
            busy = self.pending() > 0
            # Expected pushes need UCX progress on this side: poll fast.
            timeout_ms = 1 if busy else int(self.cfg.idle_poll_s * 1000)
            try:
                events = dict(self._poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_rx in events:
                self._drain_wake()
            self._drain_cmds()
            for s in list(self._socks.values()):
                if s in events:
                    self._drain_acks(s)
            self._poll_notifs()
            now = time.monotonic()
            if now >= next_expire:
                with self._lock:
                    expired = self.state.expire()
                for w in expired:
                    self.stats.inc("recv_timeout")
                    logger.warning(
                        "no push for request %s (transfer %s) from %s within %.1fs: %s",
                        w.request_id, w.transfer_id, w.peer, self.cfg.registration_timeout_s,
                        "released" if w.cancelled else "failed",
                    )
                next_expire = now + 0.05

    def _drain_cmds(self) -> None:
        for kind, arg in self._commands():
            if kind == "register":
                request_id, tid, peer, block_ids, skip = arg
                msg = M.Register(
                    transfer_id=tid, request_id=request_id, engine_id=self.engine_id,
                    agent_name=self.agent.name, agent_metadata=self.metadata, layout=self.layout,
                    block_ids=block_ids, skip_blocks=skip, probe_addr=self._probe.ctypes.data,
                    probe_len=PROBE_BYTES, host=self.cfg.side_channel_host, fabric_host=self.cfg.fabric_host or "",
                )
                self._sock(peer).send(M.encode(msg), zmq.NOBLOCK)
            elif kind == "cancel":
                tid, peer = arg
                self._sock(peer).send(M.encode(M.Cancel(tid)), zmq.NOBLOCK)

    def _drain_acks(self, s: zmq.Socket) -> None:
        while True:
            try:
                data = s.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = M.decode_ack(data)
            except M.MalformedMessage as e:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed ack: %s", e)
                continue
            if ack.status in ("accepted", "duplicate"):
                continue
            with self._lock:
                w = self.state.on_failed(ack.transfer_id)
            if w is not None:
                if not w.cancelled:
                    self.stats.inc("recv_failed")
                    logger.warning("push for %s ended as %s: %s", w.request_id, ack.status, ack.detail)

    def _poll_notifs(self) -> None:
        notifs = self.agent.get_new_notifs()
        for _, msgs in notifs.items():
            for raw in msgs:
                tid = M.parse_notif(raw)
                if tid is None:
                    continue
                with self._lock:
                    w = self.state.on_done(tid)
                if w is not None:
                    self.stats.inc("recv_ok")
