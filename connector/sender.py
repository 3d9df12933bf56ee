"""P side of the transfer engine: the writer thread that pushes KV into D.

The engine loop (vLLM's worker) only enqueues finished prefills; everything else
(control channel, lane set-up, WRITEs, progress, leases) happens on one writer
thread that owns the sockets and the NIXL agents.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from connector import messages as M
from connector.config import ConfigError, KVPathConfig
from connector.engine_thread import EngineThread
from connector.layout import LayoutMismatch, build_descs, check_compatible
from connector.params import default_lane
from connector.nixl_io import PROBE_BYTES, configure_ucx, make_agent, register, remote_endpoints, wait_xfer
from connector.push_state import FinishedPrefill, Match, WriterState
from connector.reservation_hooks import ReservationNotifier
from connector.telemetry import Stats, TraceWriter, TransferRecord

logger = logging.getLogger(__name__)


@dataclass
class Lane:
    lane_id: int
    src_ports: list[int]


@dataclass
class _Peer:
    agent_name: str
    lanes: list[Lane]


@dataclass
class _InFlight:
    match: Match
    agent: Any
    handle: Any
    record: TransferRecord
    deadline: float


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
    ):
        super().__init__(cfg, layout, spans, engine_id, rank, stats, trace, "p")
        self.on_lanes = on_lanes
        self.state = WriterState(cfg.lease_timeout_s)
        self.address = cfg.side_channel_addr(rank)
        self._finished_lock = threading.Lock()
        self._finished: set[str] = set()
        self._released: OrderedDict[str, None] = OrderedDict()
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[str, _InFlight] = {}
        self.lane_agents: list[Any] = []
        self.notifier: ReservationNotifier | None = None

    def start(self) -> "PushSender":
        configure_ucx(self.cfg)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._sockets.append(self._router)
        try:
            self._router.bind(f"tcp://{self.address}")
        except zmq.ZMQError as e:
            raise ConfigError(
                f"kv_connector_extra_config.side_channel_port: cannot listen on {self.address}: {e}"
            ) from e
        for i in range(self.cfg.lanes):
            agent = make_agent(f"{self.engine_id}-r{self.rank}-lane{i}")
            register(agent, self.spans, self.layout.mem_type, self.layout.device_id)
            register(agent, [(self._probe.ctypes.data, PROBE_BYTES)], "DRAM")
            self.lane_agents.append(agent)
        if self.cfg.reservation_url:
            self.notifier = ReservationNotifier(self.cfg.reservation_url, self.stats)
        self._start_thread(self._run, "kvpath-push-writer")
        logger.info("kvpath writer %s listening on %s with %d lanes", self.engine_id, self.address, self.cfg.lanes)
        return self

    def close(self) -> None:
        super().close()
        if self.notifier is not None:
            self.notifier.close()

    # -- called from the engine thread ---------------------------------------
    def submit_finished(
        self, request_id: str, transfer_id: str, block_ids: list[int], lane: int | None = None, lease_id: str | None = None
    ) -> None:
        self._put("finished", FinishedPrefill(request_id, transfer_id, list(block_ids), lane, lease_id))

    def abort(self, transfer_id: str) -> None:
        self._put("abort", transfer_id)

    def take_finished(self) -> set[str]:
        """P request ids whose blocks may be freed (pushed, failed or expired)."""
        with self._finished_lock:
            out, self._finished = self._finished, set()
        return out

    def lanes(self) -> dict[str, list[Lane]]:
        return {p.agent_name: list(p.lanes) for p in self._peers.values()}

    # -- writer thread ------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_expire = 0.0
        while not self._stop.is_set():
            timeout_ms = 0 if self._inflight else int(self.cfg.idle_poll_s * 1000)
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_rx in events:
                self._drain_wake()
            if self._router in events:
                self._drain_router()
            self._drain_cmds()
            if self._inflight:
                # Without NIXL's progress thread, UCX moves bytes only while we poll:
                # spin on the in-flight WRITEs for a short burst, then look at the
                # sockets again. CPU is spent only while a push is in flight.
                burst_end = time.monotonic() + 0.002
                while self._inflight and time.monotonic() < burst_end:
                    self._progress()
                time.sleep(0)  # let the engine thread take the GIL
            now = time.monotonic()
            if now >= next_expire:
                self._expire()
                next_expire = now + 0.05

    def _drain_cmds(self) -> None:
        for kind, arg in self._commands():
            if kind == "finished":
                status, m = self.state.add_prefill(arg)
                if status == "duplicate":
                    logger.warning("duplicate finished prefill for transfer %s ignored", arg.transfer_id)
                elif status == "dead":
                    logger.info("transfer %s already ended (%s): blocks freed", arg.transfer_id,
                                self.state.status_of(arg.transfer_id))
                    self._release(arg)
                elif m is not None:
                    self._start_write(m)
            elif kind == "abort":
                pr = self.state.abort_prefill(arg)
                if pr is not None:
                    self._ack(pr.reply_to, arg, "rejected", "prefill request was aborted")

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed control message (%d frames)", len(frames))
                continue
            ident, data = frames
            try:
                msg = M.decode_to_prefill(data)
            except M.MalformedMessage as e:
                self.stats.inc("messages_malformed")
                logger.warning("dropped malformed control message: %s", e)
                continue
            if isinstance(msg, M.Cancel):
                self._on_cancel(ident, msg.transfer_id)
            else:
                self._on_register(ident, msg)

    def _on_register(self, ident: bytes, reg: M.Register) -> None:
        self.stats.inc("registrations")
        try:
            check_compatible(self.layout, reg.layout)
        except LayoutMismatch as e:
            self.stats.inc("registrations_rejected")
            logger.warning("registration %s rejected: %s", reg.transfer_id, e)
            self._ack(ident, reg.transfer_id, "rejected", str(e))
            return
        status, m = self.state.add_registration(reg, ident)
        if status == "duplicate":
            self.stats.inc("registrations_duplicate")
            done = self.state.status_of(reg.transfer_id)
            logger.info("duplicate registration for %s ignored (state %s)", reg.transfer_id, done or "pending")
            return
        if status == "aborted":
            self.stats.inc("registrations_rejected")
            self._ack(ident, reg.transfer_id, "rejected", "prefill request was aborted")
            return
        try:
            self._ensure_peer(reg)
        except Exception as e:  # a peer we cannot reach: fail this transfer, keep serving
            logger.warning("cannot open lanes to %s: %s", reg.agent_name, e)
            if m is not None:
                self._fail(m, f"lane set-up failed: {e}")
            else:
                self.state.registrations.pop(reg.transfer_id, None)
                self._ack(ident, reg.transfer_id, "failed", f"lane set-up failed: {e}")
            return
        if m is not None:
            self._start_write(m)

    def _on_cancel(self, ident: bytes, tid: str) -> None:
        status, fp, _ = self.state.cancel(tid)
        if status == "in_flight":
            return  # D hears the completion notification or a failure
        if fp is not None:
            self._release(fp)
            self.stats.inc("pushes_cancelled")
            self.trace.write(TransferRecord(tid, fp.request_id, status="cancelled", prefill_done_at=fp.finished_at))
        self._ack(ident, tid, "cancelled")

    def _ensure_peer(self, reg: M.Register) -> _Peer:
        peer = self._peers.get(reg.agent_name)
        if peer is not None:
            return peer
        lanes: list[Lane] = []
        own_port = int(self.address.rpartition(":")[2])
        for i, agent in enumerate(self.lane_agents):
            # UCX may connect as soon as it learns the peer: snapshot first.
            before = remote_endpoints()
            name = agent.add_remote_agent(reg.agent_metadata)
            if reg.probe_addr and reg.probe_len:
                # A tiny WRITE opens the lane's connection now, so its source
                # port is known before the first real push is routed.
                n = min(8, reg.probe_len)
                loc = agent.get_xfer_descs(np.array([[self._probe.ctypes.data, n, 0]], dtype=np.uint64), "DRAM")
                rem = agent.get_xfer_descs(np.array([[reg.probe_addr, n, 0]], dtype=np.uint64), "DRAM")
                h = agent.initialize_xfer("WRITE", loc, rem, name)
                state = wait_xfer(agent, h, timeout_s=5.0)
                agent.release_xfer_handle(h)
                if state != "DONE":
                    raise RuntimeError(f"lane {i} probe ended in state {state}")
            new = {c for c in remote_endpoints() - before if c[1] != own_port}
            lanes.append(Lane(i, sorted(p[1] for p in new)))
        peer = _Peer(reg.agent_name, lanes)
        self._peers[reg.agent_name] = peer
        self.stats.inc("lanes_opened", len(lanes))
        logger.info("opened %d lanes to %s: source ports %s", len(lanes), reg.agent_name, [l.src_ports for l in lanes])
        self.trace.write_event(
            "lanes", peer=reg.agent_name, engine=self.engine_id, lanes=[[l.lane_id, l.src_ports] for l in lanes]
        )
        if self.notifier is not None and self.cfg.fabric_host and reg.fabric_host:
            self.notifier.register_lanes(
                self.cfg.fabric_host, reg.fabric_host, [(l.lane_id, l.src_ports[0]) for l in lanes if l.src_ports]
            )
        if self.on_lanes:
            try:
                self.on_lanes(reg.agent_name, lanes)
            except Exception:  # a telemetry callback must never break pushes
                logger.exception("on_lanes callback failed")
        return peer

    def _start_write(self, m: Match) -> None:
        fp, reg = m.prefill, m.registration.reg
        n_lanes = len(self.lane_agents)
        lane = fp.lane if fp.lane is not None and 0 <= fp.lane < n_lanes else default_lane(fp.transfer_id, n_lanes)
        peer = self._peers.get(reg.agent_name)
        rec = TransferRecord(
            transfer_id=fp.transfer_id,
            request_id=fp.request_id,
            peer_engine=reg.engine_id,
            peer_request_id=reg.request_id,
            lane=lane,
            src_port=(peer.lanes[lane].src_ports[0] if peer and peer.lanes[lane].src_ports else 0),
            lease_id=fp.lease_id or "",
            registered_at=m.registration.received_at,
            prefill_done_at=fp.finished_at,
        )
        src = fp.block_ids[reg.skip_blocks : reg.skip_blocks + len(reg.block_ids)]
        if len(src) < len(reg.block_ids):
            self._fail(m, f"P has {len(fp.block_ids)} blocks, D expects {reg.skip_blocks + len(reg.block_ids)}", rec)
            return
        agent = self.lane_agents[lane]
        try:
            loc, rem, nbytes = build_descs(self.layout, reg.layout, src, reg.block_ids)
            rec.bytes, rec.descriptors, rec.blocks = nbytes, len(loc), len(src)
            rec.submit_at = time.time()
            if len(loc) == 0:
                agent.send_notif(peer.agent_name if peer else reg.agent_name, M.make_notif(fp.transfer_id))
                rec.completed_at = time.time()
                self._succeed(m, rec)
                return
            l_d = agent.get_xfer_descs(loc, self.layout.mem_type)
            r_d = agent.get_xfer_descs(rem, reg.layout.mem_type)
            h = agent.initialize_xfer("WRITE", l_d, r_d, reg.agent_name, M.make_notif(fp.transfer_id))
            state = agent.transfer(h)
        except Exception as e:
            self._fail(m, f"posting the WRITE failed: {e}", rec)
            return
        if state == "ERR":
            agent.release_xfer_handle(h)
            self._fail(m, "NIXL refused the WRITE", rec)
            return
        self._inflight[fp.transfer_id] = _InFlight(m, agent, h, rec, time.monotonic() + self.cfg.transfer_timeout_s)
        if state == "DONE":
            self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        for tid, f in list(self._inflight.items()):
            try:
                state = f.agent.check_xfer_state(f.handle)
            except Exception as e:  # the peer vanished under the transfer
                state, why = "ERR", str(e)
            else:
                why = "transfer error"
            if state == "PROC" and now > f.deadline:
                state, why = "ERR", f"transfer timed out after {self.cfg.transfer_timeout_s}s"
            if state == "PROC":
                continue
            del self._inflight[tid]
            try:
                f.agent.release_xfer_handle(f.handle)
            except Exception:
                logger.debug("releasing handle of %s failed", tid, exc_info=True)
            if state == "DONE":
                f.record.completed_at = time.time()
                self._succeed(f.match, f.record)
            else:
                self._fail(f.match, why, f.record)

    def _succeed(self, m: Match, rec: TransferRecord) -> None:
        self.state.complete(m.prefill.transfer_id, "ok")
        self._release(m.prefill)
        self.stats.inc("pushes_ok")
        self.stats.observe_transfer(rec)
        self.trace.write(rec)
        logger.debug("pushed %s: %d B in %d descs on lane %d", rec.transfer_id, rec.bytes, rec.descriptors, rec.lane)

    def _fail(self, m: Match, why: str, rec: TransferRecord | None = None) -> None:
        tid = m.prefill.transfer_id
        self.state.active.setdefault(tid, m)
        self.state.complete(tid, "failed")
        self._release(m.prefill)
        self.stats.inc("pushes_failed")
        rec = rec or TransferRecord(tid, m.prefill.request_id)
        rec.status, rec.detail, rec.completed_at = "failed", why, time.time()
        self.trace.write(rec)
        logger.warning("push %s failed: %s", tid, why)
        self._ack(m.registration.reply_to, tid, "failed", why)

    def _expire(self) -> None:
        ex = self.state.expire()
        for fp in ex.prefills:
            self._release(fp)
            self.stats.inc("pushes_expired")
            self.trace.write(
                TransferRecord(fp.transfer_id, fp.request_id, status="expired", prefill_done_at=fp.finished_at,
                               detail=f"no registration within {self.cfg.lease_timeout_s}s")
            )
            logger.warning("lease of %s expired: D never registered; blocks freed", fp.transfer_id)
        for pr in ex.registrations:
            self.stats.inc("registrations_rejected")
            self._ack(pr.reply_to, pr.reg.transfer_id, "expired", "no matching prefill finished in time")

    def _release(self, fp: FinishedPrefill) -> None:
        """The push of ``fp`` ended (any way): free its blocks, end its reservation."""
        if fp.lease_id and self.notifier is not None:
            self.notifier.release(fp.lease_id)
        request_id = fp.request_id
        # Report each request once: vLLM frees (and forgets) it on the first report.
        if request_id in self._released:
            return
        self._released[request_id] = None
        if len(self._released) > 65536:
            self._released.popitem(last=False)
        with self._finished_lock:
            self._finished.add(request_id)

    def _ack(self, ident: bytes, tid: str, status: str, detail: str = "") -> None:
        try:
            self._router.send_multipart([ident, M.encode(M.Ack(tid, status, detail))], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("ack %s to a gone peer dropped: %s", status, e)
