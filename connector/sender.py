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
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.engine_thread import EngineThread
from kvpath.connector.lanes import Lane, LaneSet
from kvpath.connector.layout import LayoutMismatch, build_descs, check_compatible
from kvpath.connector.params import default_lane
from kvpath.connector.nixl_io import PROBE_BYTES, configure_ucx, make_agent, register
from kvpath.connector.push_state import FinishedPrefill, Match, WriterState
from kvpath.connector.reservation_hooks import ReservationNotifier
from kvpath.connector.telemetry import Stats, TraceWriter, TransferRecord

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 0.05  # reserve_at=push: how long a push waits for its lane


@dataclass
class _Peer:
    """A D worker that completed the handshake."""

    hello: M.Hello
    ident: bytes  # its control-channel identity
    lanes: LaneSet


@dataclass
class _InFlight:
    match: Match
    lane: int
    agent: Any
    handle: Any
    record: TransferRecord
    slow_at: float  # transfer_timeout_s after posting: logged and counted, not abandoned


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
        self.instance = uuid.uuid4().hex[:12]  # D tells a restarted P by a new value
        self._next_heartbeat = 0.0
        self._asking: dict[str, tuple[Match, float]] = {}  # reserve_at=push: pushes waiting for their lane

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
        # With a path oracle the pool holds lane_candidates agents per lane, so each
        # D peer's lanes can be picked to cover distinct paths.
        pool = self.cfg.lanes * (self.cfg.lane_candidates if self.oracle else 1)
        for i in range(pool):
            agent = make_agent(f"{self.engine_id}-r{self.rank}-lane{i}")
            register(agent, self.spans, self.layout.mem_type, self.layout.device_id)
            register(agent, [(self._probe.ctypes.data, PROBE_BYTES)], "DRAM")
            self.lane_agents.append(agent)
        if self.cfg.reservation_url:
            kw = {"token": self.cfg.reservation_token} if self.cfg.reservation_token else {}
            self.notifier = ReservationNotifier(self.cfg.reservation_url, self.stats, **kw)
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

    def worker_pair(self, hello: M.Hello) -> str:
        """The (P worker, D worker) pair's name in the reservation service."""
        return f"{self.engine_id}/r{self.rank}>{hello.agent_name}"

    def lanes(self) -> dict[str, list[Lane]]:
        """D agent name -> its lanes (a snapshot; for tests and tools)."""
        return {name: list(p.lanes.lanes) for name, p in self._peers.items()}

    # -- writer thread ------------------------------------------------------
    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._next_expire = 0.0
        self._loop(self._step)

    def _step(self) -> None:
        timeout_ms = 0 if self._inflight else 5 if self._asking else int(self.cfg.idle_poll_s * 1000)
        events = self._poll(timeout_ms)
        if self._asking:
            self._stop_asking()
        if events is None:
            return
        if self._router in events:
            self._drain_router()
        self._drain_cmds()
        if self._inflight:
            # Without NIXL's progress thread, UCX moves bytes only while we poll:
            # progress the in-flight WRITEs for a short burst, then look at the
            # sockets again. CPU is spent only while a push is in flight. The short
            # sleeps hand the GIL to the engine thread (the NIXL calls release it, the
            # loop around them does not), and a new push ends the burst at once.
            burst_end = time.monotonic() + 0.002
            while self._inflight and time.monotonic() < burst_end and self._cmds.empty():
                self._progress()
                time.sleep(0.0002)
        now = time.monotonic()
        if now >= self._next_expire:
            self._expire()
            self._next_expire = now + 0.05
        if now >= self._next_heartbeat:
            self._heartbeat()

    def _drain_cmds(self) -> None:
        for kind, arg in self._commands():
            if kind == "finished":
                self._on_finished(arg)
            elif kind == "reserved":
                self._on_reserved(*arg)
            elif kind == "abort":
                pr = self.state.abort_prefill(arg)
                if pr is not None:
                    self._ack(pr.reply_to, arg, "rejected", "prefill request was aborted")

    def _on_finished(self, fp: FinishedPrefill) -> None:
        status, m = self.state.add_prefill(fp)
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
        elif m is not None:
            self._start_write(m)

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
            elif isinstance(msg, M.Hello):
                self._on_hello(ident, msg)
            else:
                self._on_register(ident, msg)

    def _on_hello(self, ident: bytes, hello: M.Hello) -> None:
        """The handshake: refuse an incompatible peer naming the field, else open lanes."""
        self.stats.inc("handshakes")
        bad = self.compat.mismatch(hello.compat)
        if bad is None:
            try:
                check_compatible(self.layout, hello.layout)
            except LayoutMismatch as e:
                bad = ("kv_layout", str(e))
        if bad is not None:
            self.stats.inc("handshakes_refused")
            logger.error("refused D %s (%s): %s", hello.engine_id, hello.agent_name, bad[1])
            self._send(ident, M.Welcome(self.instance, False, bad[0], bad[1]))
            return
        peer = self._peers.get(hello.agent_name)
        if peer is None:
            lanes = LaneSet(hello, self.lane_agents, self._probe.ctypes.data, int(self.address.rpartition(":")[2]),
                            self.cfg.lanes, *self._path_rule(hello))
            try:
                lanes.open_all()
            except Exception as e:  # a peer we cannot reach: refuse, keep serving the others
                logger.warning("cannot open lanes to %s: %s", hello.agent_name, e)
                for i in range(len(lanes.lanes)):
                    lanes.tear_down(i)
                self._send(ident, M.Welcome(self.instance, False, "lanes", f"lane set-up failed: {e}"))
                return
            peer = self._peers[hello.agent_name] = _Peer(hello, ident, lanes)
            self._lanes_opened(peer)
        peer.ident = ident
        self._welcome(peer)

    def _welcome(self, peer: _Peer) -> None:
        lanes = [(l.src_ip, l.src_port) for l in peer.lanes.lanes if l.src_port]
        self._send(peer.ident, M.Welcome(self.instance, True, lanes=lanes))

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

    def _lanes_opened(self, peer: _Peer) -> None:
        lanes, h = peer.lanes.lanes, peer.hello
        self.stats.inc("lanes_opened", len(lanes))
        logger.info("opened %d lanes to %s (%d candidates tried): %s", len(lanes), h.agent_name,
                    peer.lanes.candidates_opened or len(lanes),
                    [f"{l.src_ip}:{l.src_port}->{l.dst_ip}:{l.dst_port}{' via ' + l.path if l.path else ''}"
                     for l in lanes])
        self.trace.write_event("lanes", peer=h.agent_name, engine=self.engine_id,
                               lanes=[[l.lane_id, *l.five_tuple(), l.path] for l in lanes])
        self._register_lanes(peer)
        if self.on_lanes:
            try:
                self.on_lanes(h.agent_name, list(lanes))
            except Exception:  # a telemetry callback must never break pushes
                logger.exception("on_lanes callback failed")

    def _register_lanes(self, peer: _Peer) -> None:
        """Tell the reservation service this worker pair's lanes (full 5-tuples)."""
        h = peer.hello
        if self.notifier is not None and self.cfg.fabric_host and h.fabric_host:
            rows = [{"lane": l.lane_id, "src_ip": l.src_ip, "src_port": l.src_port, "dst_ip": l.dst_ip,
                     "dst_port": l.dst_port, "proto": "tcp"} for l in peer.lanes.lanes if l.src_port]
            self.notifier.register_lanes(self.cfg.fabric_host, h.fabric_host, rows, self.worker_pair(h))

    def _on_register(self, ident: bytes, reg: M.Register) -> None:
        self.stats.inc("registrations")
        tid = reg.transfer_id
        peer = self._peers.get(reg.agent_name)
        if peer is None:  # no handshake with this D (P restarted since): D says Hello again
            self._ack(ident, tid, "unknown_peer", "no handshake with this D worker")
            return
        bad = [b for b in reg.block_ids if b >= peer.hello.layout.num_blocks]
        if bad:
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", f"block id {bad[0]} outside D's {peer.hello.layout.num_blocks} blocks")
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
        status, m = self.state.add_registration(reg, ident, post_by)
        if status == "duplicate":
            self.stats.inc("registrations_duplicate")
            logger.warning("registration of %s for transfer %s rejected: the transfer id is taken (state %s)",
                           reg.request_id, tid, self.state.status_of(tid) or "pending")
            self._ack(ident, tid, "rejected", "transfer id already registered by another request")
            return
        if status == "aborted":
            self.stats.inc("registrations_rejected")
            self._ack(ident, tid, "rejected", "prefill request was aborted")
            return
        self._ack(ident, tid, "accepted")
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

    def _heartbeat(self) -> None:
        """Tell each D that P still holds its registrations (so D's clock measures
        P's liveness, not P's queue)."""
        by_ident: dict[bytes, list[str]] = {}
        for pr in self.state.held_registrations():
            by_ident.setdefault(pr.reply_to, []).append(pr.reg.transfer_id)
        for ident, tids in by_ident.items():
            self._send(ident, M.Pending(tids))
        beat = min((p.hello.heartbeat_s for p in self._peers.values()), default=1.0)
        self._next_heartbeat = time.monotonic() + beat

    def _ask_lane(self, m: Match) -> bool:
        """reserve_at=push: ask the reservation service for this push's lane first (on
        the notifier's thread); the WRITE starts when the answer comes. False when
        there is nothing to ask (a lane was given, no service, hosts unknown)."""
        fp = m.prefill
        if self.cfg.reserve_at != "push" or fp.lane is not None or fp.lane_asked or self.notifier is None:
            return False
        peer = self._peers.get(m.registration.reg.agent_name)
        if peer is None or not peer.hello.fabric_host:
            return False
        fp.lane_asked = True
        nbytes = len(m.registration.reg.block_ids) * sum(r.block_len for r in self.layout.regions)
        self._asking[fp.transfer_id] = (m, time.monotonic())
        self.notifier.reserve(self.cfg.fabric_host, peer.hello.fabric_host, nbytes, fp.transfer_id,
                              lambda tid, lane, lease: self._put("reserved", (tid, lane, lease)))
        return True

    def _on_reserved(self, tid: str, lane: int | None, lease_id: str | None) -> None:
        asked = self._asking.pop(tid, None)
        if asked is None:  # too late: the push went on the hash's lane; free what was reserved
            if lease_id and self.notifier is not None:
                self.notifier.release(lease_id)
            return
        m = asked[0]
        m.prefill.lane, m.prefill.lease_id = lane, lease_id  # None: the hash's lane
        self.stats.inc("lanes_reserved_at_push" if lane is not None else "lanes_reserve_fallback")
        self._start_write(m)

    def _stop_asking(self) -> None:
        """A push waits ASK_TIMEOUT_S at most for its lane, then goes on the hash's lane."""
        now = time.monotonic()
        for tid, (m, at) in list(self._asking.items()):
            if now - at > ASK_TIMEOUT_S:
                del self._asking[tid]
                self.stats.inc("lanes_reserve_fallback")
                self._start_write(m)

    def _start_write(self, m: Match) -> None:
        if self._ask_lane(m):
            return
        fp, pr = m.prefill, m.registration
        reg = pr.reg
        n_lanes = self.cfg.lanes
        lane = fp.lane if fp.lane is not None and 0 <= fp.lane < n_lanes else default_lane(fp.transfer_id, n_lanes)
        peer = self._peers[reg.agent_name]
        rec = TransferRecord(
            transfer_id=fp.transfer_id, request_id=fp.request_id, peer_engine=peer.hello.engine_id,
            peer_request_id=reg.request_id, lane=lane, lease_id=fp.lease_id or "",
            registered_at=pr.received_at, prefill_done_at=fp.finished_at,
        )
        if time.monotonic() >= pr.post_by:
            self._fail(m, "D's post_by deadline passed before the prefill finished", rec)
            return
        src = fp.block_ids[reg.skip_blocks : reg.skip_blocks + len(reg.block_ids)]
        if len(src) < len(reg.block_ids):
            self._fail(m, f"P has {len(fp.block_ids)} blocks, D expects {reg.skip_blocks + len(reg.block_ids)}", rec)
            return
        agent = peer.lanes.agent(lane)
        try:
            if peer.lanes.lanes[lane].broken:
                peer.lanes.ensure(lane)
                self._welcome(peer)  # D learns the new connection before any byte moves on it
                self._register_lanes(peer)
            rec.src_port = peer.lanes.lanes[lane].src_port
            loc, rem, nbytes = build_descs(self.layout, peer.hello.layout, src, reg.block_ids)
            rec.bytes, rec.descriptors, rec.blocks = nbytes, len(loc), len(src)
            rec.submit_at = time.time()
            if len(loc) == 0:
                self._send(pr.reply_to, M.Ack(fp.transfer_id, "posted"))
                agent.send_notif(reg.agent_name, M.make_notif(fp.transfer_id))
                rec.completed_at = time.time()
                self._succeed(m, rec)
                return
            l_d = agent.get_xfer_descs(loc, self.layout.mem_type)
            r_d = agent.get_xfer_descs(rem, peer.hello.layout.mem_type)
            h = agent.initialize_xfer("WRITE", l_d, r_d, reg.agent_name, M.make_notif(fp.transfer_id))
        except Exception as e:  # nothing was posted
            self._fail(m, f"preparing the WRITE failed: {e}", rec)
            return
        self._send(pr.reply_to, M.Ack(fp.transfer_id, "posted", bytes=nbytes))  # D: progress fast now
        try:
            state = agent.transfer(h)
        except Exception as e:
            state = "ERR"
            logger.warning("posting the WRITE of %s raised: %s", fp.transfer_id, e)
        f = _InFlight(m, lane, agent, h, rec, time.monotonic() + self.cfg.transfer_timeout_s)
        if state == "ERR":
            self._failed_write(f, "NIXL refused the WRITE")
            return
        self._inflight[fp.transfer_id] = f
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
            if state == "PROC":
                if now > f.slow_at:
                    f.slow_at = float("inf")
                    self.stats.inc("pushes_slow")
                    logger.warning("push %s still running after %.1fs; waiting for UCX to finish or fail it",
                                   tid, self.cfg.transfer_timeout_s)
                continue
            del self._inflight[tid]
            if state == "DONE":
                self._release_handle(f)
                f.record.completed_at = time.time()
                self._succeed(f.match, f.record)
            else:
                self._failed_write(f, why)

    def _release_handle(self, f: _InFlight) -> None:
        try:
            f.agent.release_xfer_handle(f.handle)
        except Exception:
            logger.debug("releasing handle of %s failed", f.match.prefill.transfer_id, exc_info=True)

    def _failed_write(self, f: _InFlight, why: str) -> None:
        """UCX reported the WRITE failed: it no longer reads the source blocks, and its
        connection is broken. The lane is reopened on its next use."""
        self._inflight.pop(f.match.prefill.transfer_id, None)
        self._release_handle(f)
        peer = self._peers.get(f.match.registration.reg.agent_name)
        if peer is not None:
            peer.lanes.tear_down(f.lane)
            self.stats.inc("lanes_torn_down")
        self._fail(f.match, why, f.record, posted=True)

    def _succeed(self, m: Match, rec: TransferRecord) -> None:
        self.state.complete(m.prefill.transfer_id, "ok")
        self._release(m.prefill)
        self.stats.inc("pushes_ok")
        self.stats.observe_transfer(rec)
        self.trace.write(rec)
        logger.debug("pushed %s: %d B in %d descs on lane %d", rec.transfer_id, rec.bytes, rec.descriptors, rec.lane)

    def _fail(self, m: Match, why: str, rec: TransferRecord | None = None, posted: bool = False) -> None:
        tid = m.prefill.transfer_id
        self.state.active.setdefault(tid, m)
        self.state.complete(tid, "failed")
        self._release(m.prefill)
        self.stats.inc("pushes_failed")
        rec = rec or TransferRecord(tid, m.prefill.request_id)
        rec.status, rec.detail, rec.completed_at = "failed", why, time.time()
        self.trace.write(rec)
        logger.warning("push %s failed: %s", tid, why)
        self._ack(m.registration.reply_to, tid, "failed", why, posted)

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

    def _ack(self, ident: bytes, tid: str, status: str, detail: str = "", posted: bool = False) -> None:
        self._send(ident, M.Ack(tid, status, detail, posted))

    def _send(self, ident: bytes, msg: Any) -> None:
        try:
            self._router.send_multipart([ident, M.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a gone peer: its own deadlines end its requests
            logger.debug("%s to a gone peer dropped: %s", type(msg).__name__, e)
