"""P side of the transfer engine: the writer thread that pushes KV into D.

The engine loop (vLLM's worker) only enqueues finished prefills; everything else
happens on one writer thread that owns the sockets and the NIXL agents. Its code
is in three parts, one module each, all methods of :class:`PushSender`:

- :mod:`~kvpath.connector.control_channel`: the ZMQ side channel, messages in and out;
- :mod:`~kvpath.connector.lane_setup`: the handshake, opening and announcing lanes;
- :mod:`~kvpath.connector.write_loop`: posting WRITEs, their completion, leases.

This module holds the thread itself: start, the loop's step, the engine-side API.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.control_auth import CurveServer
from kvpath.connector.control_channel import ControlChannel
from kvpath.connector.engine_thread import DORMANT_POLL_MS, LINGER_S, EngineThread
from kvpath.connector.lane_setup import LaneOpening, LaneSetup, Peer
from kvpath.connector.lanes import Lane
from kvpath.connector.nixl_io import configure_ucx
from kvpath.connector.parked_pushes import ParkedPushes
from kvpath.connector.push_state import FinishedPrefill, Match, WriterState
from kvpath.connector.step_commands import VllmTimes
from kvpath.connector.telemetry import Stats
from kvpath.connector.write_loop import InFlight, WriteLoop
from kvpath.reservation.notifier import ReservationNotifier, reservation_token
from kvpath.trace import TraceWriter, TransferRecord

if TYPE_CHECKING:
    from kvpath.oracle import KernelOracle, ModelOracle

__all__ = ["PushSender"]

logger = logging.getLogger(__name__)


class PushSender(ControlChannel, LaneSetup, ParkedPushes, WriteLoop, EngineThread):
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
        self.on_lanes = on_lanes
        self.state = WriterState(cfg.lease_timeout_s)
        self.address = cfg.side_channel_addr(rank)
        self._finished_lock = threading.Lock()
        self._finished: set[str] = set()
        self._released: OrderedDict[str, None] = OrderedDict()
        self._peers: dict[str, Peer] = {}
        self._inflight: dict[str, InFlight] = {}
        self.lane_agents: list[Any] = []
        self.oracle: ModelOracle | KernelOracle | None = None  # set by start() when a fabric spec is given
        self.notifier: ReservationNotifier | None = None
        self.instance = uuid.uuid4().hex[:12]  # D tells a restarted P by a new value
        self._next_heartbeat = 0.0
        self._asking: dict[str, tuple[Match, float]] = {}  # reserve_at=push: pushes waiting for their lane
        self._opening: LaneOpening | None = None  # the lane set-up in progress
        self._hellos: OrderedDict[str, tuple[bytes, M.Hello]] = OrderedDict()  # set-ups queued behind it
        self._reopens: OrderedDict[tuple[str, int], None] = OrderedDict()  # (D agent, lane) to reopen
        # pushes to a D with no lane open, waiting for a lane's reopen: D agent -> them
        self._parked: dict[str, list[tuple[Match, TransferRecord]]] = {}
        self._curve: CurveServer | None = None  # the control channel's CURVE context (keys given)
        self.public_key: bytes | None = None  # P's CURVE public key (z85), D's server key for us

    def start(self) -> "PushSender":
        configure_ucx(self.cfg)
        self._open_router()
        self._make_oracle()
        self._make_lane_agents()
        if self.cfg.reservation_url:
            self.notifier = ReservationNotifier(self.cfg.reservation_url, self.stats,
                                                token=reservation_token(self.cfg))
        self._start_thread(self._run, "kvpath-push-writer")
        logger.info("kvpath writer %s listening on %s with %d lanes", self.engine_id, self.address, self.cfg.lanes)
        return self

    def close(self) -> bool:
        stopped = super().close()
        if self._curve is not None and stopped:  # after the router socket is closed (ctx.term waits for it)
            self._curve.close()
        if self.notifier is not None:
            self.notifier.close()
        return stopped

    def _drop_agents(self) -> None:
        for f in list(self._inflight.values()):  # shutdown: nobody will complete them
            self._release_handle(f)
        self._inflight.clear()
        self._abandon_lane_setups()
        for peer in list(self._peers.values()):
            for i in range(len(peer.lanes.lanes)):
                peer.lanes.tear_down(i)
            self._unregister_lanes(peer)  # sent by the notifier's close, after this
        self._peers.clear()
        self.lane_agents = []
    # -- called from the engine thread ---------------------------------------
    def submit_finished(
        self, request_id: str, transfer_id: str, block_ids: list[int], lane: int | None = None,
        lease_id: str | None = None, transfer_key: str = "", times: VllmTimes | None = None,
    ) -> None:
        """``times``: vLLM's own times of the request, carried into its TransferRecord."""
        self._put("finished", FinishedPrefill(request_id, transfer_id, list(block_ids), lane, lease_id,
                                              transfer_key=transfer_key, times=times))

    def abort(self, transfer_id: str) -> None:
        self._put("abort", transfer_id)

    def has_results(self) -> bool:
        with self._finished_lock:
            return bool(self._finished)

    def take_finished(self) -> set[str]:
        """P request ids whose blocks may be freed (pushed, failed or expired)."""
        with self._finished_lock:
            out, self._finished = self._finished, set()
        return out

    # -- writer thread ------------------------------------------------------
    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._next_expire = 0.0
        self._next_prune = 0.0
        self._active_until = 0.0
        self._loop(self._step)

    def _step(self) -> None:
        now = time.monotonic()
        setting_up = self._opening is not None or bool(self._hellos) or bool(self._reopens)
        if self._inflight or self._asking or setting_up or not self.state.idle():
            self._active_until = now + LINGER_S
        # a WRITE past transfer_timeout_s (a stuck peer) is progressed every millisecond,
        # not in a busy loop: it must not cost P a core for as long as UCX takes to fail it;
        # a lane set-up's probe is polled every millisecond, between the other work
        spinning = any(not f.slow for f in self._inflight.values())
        timeout_ms = (0 if spinning else 1 if (self._inflight or setting_up) else 5 if self._asking
                      else int(self.cfg.idle_poll_s * 1000) if now < self._active_until else DORMANT_POLL_MS)
        events = self._poll(timeout_ms)
        if self._asking:
            self._stop_asking()
        if events is None:
            return
        if self._router in events:
            self._drain_router()
        if self._monitor in events:
            self._drain_monitor()
        self._drain_cmds()
        if spinning:
            # Without NIXL's progress thread, UCX moves bytes only while we poll:
            # progress the in-flight WRITEs for a short burst, then look at the
            # sockets again. CPU is spent only while a push is in flight. The short
            # sleeps hand the GIL to the engine thread (the NIXL calls release it, the
            # loop around them does not), and a new push ends the burst at once.
            burst_end = time.monotonic() + 0.002
            while self._inflight and time.monotonic() < burst_end and self._cmds.empty():
                self._progress()
                time.sleep(0.0002)
        elif self._inflight:
            self._progress()
        if self._opening is not None or self._hellos or self._reopens:
            self._step_lane_setup()
        now = time.monotonic()
        if now >= self._next_expire:
            self._expire()
            self._next_expire = now + 0.05
        if now >= self._next_prune:
            self._prune_peers(now)
            self._refresh_registrations(now)
            self._next_prune = now + 1.0
        if now >= self._next_heartbeat:
            self._heartbeat()

    def _drain_cmds(self) -> None:
        for kind, arg in self._commands():
            if kind == "finished":
                self._on_finished(arg)
            elif kind == "reserved":
                self._on_reserved(*arg)
            elif kind == "abort":
                for pr in self.state.abort_prefill(arg):
                    self._ack(pr.reply_to, arg, "rejected", "prefill request was aborted")

    def _start_matched(self, m: Match) -> None:
        """Start a matched flow's push; a push that raises before anything was posted or
        queued fails cleanly (its blocks freed, D answered), never strands the match."""
        try:
            self._start_write(m)
        except Exception as e:
            self.stats.inc("engine_thread_errors")
            logger.exception("starting push %s failed", m.prefill.transfer_id)
            key = m.prefill.key
            waiting = key in self._inflight or key in self._asking or any(
                x.prefill.key == key for parked in self._parked.values() for x, _ in parked)
            if self.state.active.get(key) is m and not waiting:  # nothing posted, nothing pending
                self._fail(m, f"starting the push failed: {e}")

    def _on_finished(self, fp: FinishedPrefill) -> None:
        status, matches = self.state.add_prefill(fp)
        if status == "duplicate":
            holder = self.state.holder(fp.transfer_id)
            if holder != fp.request_id:
                # Another P request already holds this transfer id (a reused id, n > 1):
                # this one's KV goes nowhere, so its blocks are freed now, not leaked.
                self.stats.inc("prefills_duplicate")
                logger.warning("request %s reuses transfer id %s held by request %s: its blocks are freed",
                               fp.request_id, fp.transfer_id, holder)
                self._release(fp)
        elif status == "dead":
            logger.info("transfer %s already ended (%s): blocks freed", fp.transfer_id,
                        self.state.status_of(fp.transfer_id))
            self._release(fp)
        elif status == "refused":
            self._refuse_prefill(fp)
        for m in matches:
            if self.state.active.get(m.prefill.key) is not m:
                # a registration without the transfer's key: the flow's prefill waits on
                self._refuse_key(m.registration.reply_to, fp.transfer_id)
                continue
            self._start_matched(m)  # each flow on its own: one that raises must not strand its siblings

