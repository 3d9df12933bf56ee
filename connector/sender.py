"""P side of the transfer engine: the writer thread that pushes KV into D.

The engine loop (vLLM's worker) only enqueues finished prefills; everything else
happens on one writer thread that owns the sockets and the NIXL agents. The writer is
made of parts, one module each, each owning its state, composed here:

- :mod:`~kvpath.connector.control_channel`: the ZMQ side channel's socket, messages in and out;
- :mod:`~kvpath.connector.lane_setup`: the D workers known, the handshake, opening lanes;
- :mod:`~kvpath.connector.flow_matching`: prefills matched with D's registrations, Cancels;
- :mod:`~kvpath.connector.write_loop`: a push's lane, its WRITE, its end (with
  :mod:`~kvpath.connector.parked_pushes`, those waiting for a lane);
- :mod:`~kvpath.connector.freed_blocks`: P requests whose blocks the engine may free.

This module holds the thread itself: start, the loop's step, the engine-side API.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from typing import Callable

import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.control_channel import ControlChannel
from kvpath.connector.engine_thread import DORMANT_POLL_MS, LINGER_S, EngineThread
from kvpath.connector.flow_matching import FlowMatching
from kvpath.connector.freed_blocks import FreedBlocks
from kvpath.connector.lane_setup import LaneSetup
from kvpath.connector.lanes import Lane
from kvpath.connector.layer_progress import ForwardLayers, LayerProgress, drain
from kvpath.connector.nixl_io import configure_ucx
from kvpath.connector.push_state import FinishedPrefill, SenderState
from kvpath.connector.step_commands import VllmTimes
from kvpath.connector.telemetry import Stats
from kvpath.connector.write_loop import WriteLoop
from kvpath.reservation.notifier import ReservationNotifier, reservation_token
from kvpath.trace import TraceWriter

__all__ = ["PushSender"]

logger = logging.getLogger(__name__)


class PushSender(EngineThread):
    def __init__(
        self,
        cfg: KVPathConfig,
        layout: M.BlockLayout,
        spans: list[tuple[int, int]],
        engine_id: str | None = None,
        rank: int = 0,
        stats: Stats | None = None,
        trace: TraceWriter | None = None,
        on_lanes: Callable[[str, list[Lane]], None] | None = None,
        compat: M.Compat | None = None,
    ):
        super().__init__(cfg, layout, spans, engine_id, rank, stats, trace, "p", compat)
        self.state = SenderState(cfg.lease_timeout_s)
        self.address = cfg.side_channel_addr(rank)
        # instance: D tells a restarted P by a new value
        self.channel = ControlChannel(cfg, self._ctx, self.stats, uuid.uuid4().hex[:12], self.address)
        self.freed = FreedBlocks(self.state, on_ready=lambda: self.results_ready.set())
        self.lanes = LaneSetup(
            cfg, layout, self.compat, self.engine_id, rank, self.stats, self.channel, spans=spans,
            probe_addr=self.probe.ctypes.data, register_memory=self._register, record=self.record,
            on_lanes=on_lanes, on_reopen_ended=lambda name, why: self.writes.reopen_ended(name, why),
            busy=self._busy_peers)
        self.writes = WriteLoop(cfg, layout, self.compat, self.state, self.stats, self.channel, self.lanes,
                                self.freed, record=self.record, put=self.put, kv_verify=self.kv_verify,
                                kv_dump=self.kv_dump)
        self.flows = FlowMatching(self.compat, self.state, self.stats, self.channel, self.lanes, self.writes,
                                  self.freed, self.record)
        self.active_until = 0.0  # monotonic: poll at the idle pace until then, then go dormant
        # push_granularity=layer: (forward, layers done) from the engine thread, lock-free
        self._layer_events: deque[tuple[int, int]] = deque(maxlen=65536)
        self.forwards = ForwardLayers()

    @property
    def notifier(self) -> ReservationNotifier | None:
        """The reservation service's client (``reservation_url`` set), made by start()."""
        return self.writes.notifier

    @notifier.setter
    def notifier(self, notifier: ReservationNotifier | None) -> None:
        # every part that calls the service holds it: set on one, it must be set on all
        self.lanes.notifier = self.writes.notifier = self.freed.notifier = notifier

    @property
    def instance(self) -> str:
        """This P process, as every Welcome and Ack names it."""
        return self.channel.instance

    @property
    def public_key(self) -> bytes | None:
        """P's CURVE public key (z85), D's server key for us (None: loopback plaintext)."""
        return self.channel.public_key

    def start(self) -> "PushSender":
        try:
            configure_ucx(self.cfg)
            monitor, router = self.channel.open()
            self._sockets.insert(0, monitor)  # closed before the router
            self._sockets.append(router)
            self.lanes.make_oracle()
            self.lanes.make_agents()
            if self.cfg.reservation_url:
                self.notifier = ReservationNotifier(self.cfg.reservation_url, self.stats,
                                                    token=reservation_token(self.cfg))
            self._start_thread(self._run, "kvpath-push-sender")
        except BaseException:
            # nobody closes a writer that failed to start: it frees what it holds now (a
            # ZMQ context left to the garbage collector can block the process in its term)
            self.close()
            raise
        logger.info("kvpath writer %s listening on %s with %d lanes", self.engine_id, self.address, self.cfg.lanes)
        return self

    def close(self) -> bool:
        stopped = super().close()
        if stopped:  # after the router socket is closed (ctx.term waits for it)
            self.channel.close()
        if self.notifier is not None:
            self.notifier.close()
        return stopped

    def _drop_agents(self) -> None:
        self.writes.drop_all()
        self.lanes.drop_all()

    def _busy_peers(self) -> set[str]:
        """D workers something is held for: a registration, or a push."""
        return {pr.reg.agent_name for pr in self.state.held_registrations()} | self.writes.busy_peers()

    # -- called from the engine thread ---------------------------------------
    def submit_finished(
        self, request_id: str, transfer_id: str, block_ids: list[int], lane: int | None = None,
        lease_id: str | None = None, transfer_key: str = "", times: VllmTimes | None = None,
    ) -> None:
        """``times``: vLLM's own times of the request, carried into its TransferRecord."""
        self.put("finished", FinishedPrefill(request_id, transfer_id, list(block_ids), lane, lease_id,
                                             transfer_key=transfer_key, times=times))

    def abort(self, transfer_id: str, request_id: str | None = None) -> None:
        """P's request ended without its KV: ``request_id`` names a begun (layer-wise)
        request, whose blocks the writer reports once nothing reads them."""
        self.put("abort", (transfer_id, request_id))

    def begin(self, request_id: str, transfer_id: str, block_ids: list[int], lane: int | None, lease_id: str | None,
              transfer_key: str, forward: int, layers: int, final_before: int = 0,
              final_after: int | None = None, first: bool = True) -> None:
        """Forward ``forward`` computes a part of this request's prompt (push_granularity
        layer or chunk; the first call begins its push, later ones feed it): the tokens
        final before it (``final_before``) go at once; an earlier chunk's (up to
        ``final_after``) when the forward ends; the last (``final_after`` None) layer by
        layer. ``first``: the push's first forward (a later one never begins a push the
        writer did not take: it would lack the lane, lease and key). ``submit_finished``
        commits the push."""
        progress = LayerProgress(layers, forward)
        progress.feed(forward, final_before, final_after)
        self.put("begin", (FinishedPrefill(request_id, transfer_id, list(block_ids), lane, lease_id,
                                           transfer_key=transfer_key, progress=progress), first))

    def restart(self, transfer_id: str, request_id: str) -> None:
        """vLLM preempted a begun request (its blocks are freed): its push starts anew when
        it is scheduled again, after its WRITEs in flight have ended."""
        self.put("restart", (transfer_id, request_id))

    def layers_done(self, forward: int, layers: int) -> None:
        """From ``save_kv_layer``, inside the forward: a deque append, nothing else (no
        lock, no wake-up, no NIXL call: the writer polls every millisecond meanwhile)."""
        self._layer_events.append((forward, layers))

    def forward_done(self, forward: int, layers: int) -> None:
        """From ``wait_for_save``: the forward has computed every layer."""
        self._layer_events.append((forward, layers))
        self._wake()

    def has_results(self) -> bool:
        return self.freed.pending()

    def take_finished(self) -> set[str]:
        """P request ids whose blocks may be freed (pushed, failed or expired)."""
        return self.freed.take()

    def lane_map(self) -> dict[str, list[Lane]]:
        """D agent name -> its lanes (a snapshot; for tests and tools)."""
        return self.lanes.lanes()

    # -- writer thread ------------------------------------------------------
    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self.channel.router, zmq.POLLIN)
        self._poller.register(self.channel.monitor, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._next_expire = 0.0
        self._next_prune = 0.0
        self.active_until = 0.0
        self._loop(self.step)

    def step(self) -> None:
        now = time.monotonic()
        writes, setting_up = self.writes, self.lanes.setting_up()
        if writes.busy() or setting_up or not self.state.idle():
            self.active_until = now + LINGER_S
        # a WRITE past transfer_timeout_s (a stuck peer) is progressed every millisecond,
        # not in a busy loop: it must not cost P a core for as long as UCX takes to fail it;
        # a lane set-up's probe is polled every millisecond, between the other work
        spinning = writes.spinning()
        timeout_ms = (0 if spinning else 1 if (writes.posting() or setting_up or self.forwards.live())
                      else 5 if writes.asking or len(writes.queue)
                      else int(self.cfg.idle_poll_s * 1000) if now < self.active_until else DORMANT_POLL_MS)
        events = self.poll_events(timeout_ms)
        if writes.asking:
            writes.stop_asking()
        if len(writes.queue):
            writes.pump_queue()
        if events is None:
            return
        if self.channel.router in events:
            self._on_messages()
        if self.channel.monitor in events:
            self.channel.drain_monitor()
        self.drain_commands()
        reports = drain(self._layer_events)
        if reports and self.forwards.apply(reports, time.time()):
            writes.advance()
        if spinning:
            # Without NIXL's progress thread, UCX moves bytes only while we poll:
            # progress the in-flight WRITEs for a short burst, then look at the
            # sockets again. CPU is spent only while a push is in flight. The short
            # sleeps hand the GIL to the engine thread (the NIXL calls release it, the
            # loop around them does not), and a new push ends the burst at once.
            burst_end = time.monotonic() + 0.002
            while writes.in_flight and time.monotonic() < burst_end and self._cmds.empty():
                writes.progress()
                time.sleep(0.0002)
        elif writes.in_flight:
            writes.progress()
        if self.lanes.setting_up():
            self.lanes.step()
        now = time.monotonic()
        if now >= self._next_expire:
            writes.expire()
            self._next_expire = now + 0.05
        if now >= self._next_prune:
            self.lanes.prune(now)
            self.lanes.refresh_registrations(now)
            self._next_prune = now + 1.0
        if now >= self.flows.next_heartbeat:
            self.flows.heartbeat()

    def _on_messages(self) -> None:
        for ident, msg in self.channel.receive():
            if isinstance(msg, M.Cancel):
                self.flows.on_cancel(ident, msg.transfer_id)
            elif isinstance(msg, M.Hello):
                self.lanes.on_hello(ident, msg)
            else:
                self.flows.on_register(ident, msg)

    def drain_commands(self) -> None:
        for kind, arg in self._commands():
            if kind == "finished":
                self.flows.on_finished(arg)
            elif kind == "reserved":
                self.writes.on_reserved(*arg)
            elif kind == "abort":
                self.flows.on_abort(*arg)
            elif kind == "begin":
                fp, first = arg
                b = self.flows.begun.get(fp.transfer_id)
                if b is not None and b.request_id == fp.request_id:  # the next forward of a begun push
                    self.flows.on_feed(b, fp)
                    self.forwards.begin(b.progress)
                    self.writes.advance()
                elif first and self.flows.can_begin(fp):
                    self.forwards.begin(fp.progress)  # the layers reported so far: its catch-up
                    self.flows.on_begin(fp)
            elif kind == "restart":
                b = self.flows.on_restart(*arg)
                if b is not None:
                    self.forwards.forget(b.progress)
        self.forwards.prune(time.time())
