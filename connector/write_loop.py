"""P's write loop: a matched push (finished prefill + D's registration) gets its lane
(given, asked of the reservation service at push time, or the hash's), its WRITE is
posted on that lane's agent and progressed until NIXL says done or failed; then the
blocks are freed, the reservation ended, D told, and the transfer record written.
This part owns the pushes asking for a lane, waiting for one (:mod:`parked_pushes`)
and in flight. Every method runs on the writer thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvpath.connector import messages as M
from kvpath.connector.config import RESERVE_AT_PUSH, KVPathConfig
from kvpath.connector.control_channel import ControlChannel
from kvpath.connector.freed_blocks import FreedBlocks
from kvpath.connector.kv_dump import KVDump
from kvpath.connector.kv_verify import Verifier
from kvpath.connector.layer_writes import InFlight, LayerWrites, final_times
from kvpath.connector.lane_setup import MAX_QUEUED_SETUPS, LaneSetup, Peer
from kvpath.connector.parked_pushes import ParkedPushes
from kvpath.connector.push_descs import PushDescs
from kvpath.connector.push_order import PushQueue, UplinkSlots
from kvpath.connector.push_state import Match, SenderState
from kvpath.connector.telemetry import Stats
from kvpath.reservation.decisions import default_lane
from kvpath.reservation.notifier import ReservationNotifier
from kvpath.reservation.wire import FlowScope
from kvpath.trace import TransferRecord

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 0.05  # reserve_at=push: how long a push waits for its lane


class WriteLoop:
    """Matched pushes, from their lane to their end."""

    def __init__(
        self, cfg: KVPathConfig, layout: M.BlockLayout, compat: M.Compat, state: SenderState, stats: Stats,
        channel: ControlChannel, lanes: LaneSetup, freed: FreedBlocks, *, record: Callable[[Any], None],
        put: Callable[[str, Any], None], kv_verify: Verifier | None = None, kv_dump: KVDump | None = None,
    ):
        self.cfg, self.layout, self.compat, self.state, self.stats = cfg, layout, compat, state, stats
        self.channel, self.lanes, self.freed = channel, lanes, freed
        self._record, self._put = record, put  # put: hands a reservation's answer back to the writer thread
        self.kv_verify, self.kv_dump = kv_verify, kv_dump
        self.plans = PushDescs(layout, compat, lanes.same_sizes)
        self.layers = LayerWrites(self)
        self.notifier: ReservationNotifier | None = None  # set by the sender's start()
        self.parked = ParkedPushes()
        self.in_flight: dict[str, InFlight] = {}  # flow key -> its posted WRITE
        self.asking: dict[str, tuple[Match, float]] = {}  # reserve_at=push: pushes waiting for their lane
        self.queue = PushQueue(cfg.push_order, self._uplink_slots(), cfg.push_queue_max_wait_s)

    def _uplink_slots(self) -> UplinkSlots | None:
        if not self.cfg.uplink_pushes:
            return None
        try:
            return UplinkSlots(self.cfg.fabric_host or "local", self.cfg.uplink_pushes, self.cfg.uplink_slots_dir)
        except OSError as e:  # (a directory we cannot write: pushes go uncapped, as before the knob)
            logger.warning("uplink_pushes: no slot files in %s (%s): pushes are not capped", self.cfg.uplink_slots_dir, e)
            return None

    def spinning(self) -> bool:
        """A WRITE in flight is progressed in a busy loop (none is past transfer_timeout_s)."""
        return any(f.handles and not f.slow for f in self.in_flight.values())

    def posting(self) -> bool:
        """A WRITE is in flight (a layer-wise flow waiting for its prefill has none: it
        moves on the engine's reports and commands, which wake the writer)."""
        return any(f.handles for f in self.in_flight.values())

    def busy(self) -> bool:
        return bool(self.in_flight) or bool(self.asking) or bool(len(self.queue))

    def holds(self, key: str) -> bool:
        """Flow ``key`` is in flight, asking for its lane or waiting for one."""
        return key in self.in_flight or key in self.asking or self.parked.holds(key) or self.queue.holds(key)

    def busy_peers(self) -> set[str]:
        """D agent names a push is in flight, asking or waiting for."""
        busy = {f.match.registration.reg.agent_name for f in self.in_flight.values()}
        busy |= {m.registration.reg.agent_name for m, _ in self.asking.values()}
        busy |= {m.registration.reg.agent_name for m in self.queue.waiting()}
        return busy | set(self.parked.names())

    def _ask_lane(self, m: Match) -> bool:
        """reserve_at=push: ask the reservation service for this push's lane first (on
        the notifier's thread); the WRITE starts when the answer comes. False when
        there is nothing to ask (a lane was given, no service, hosts unknown)."""
        fp = m.prefill
        if self.cfg.reserve_at != RESERVE_AT_PUSH or fp.lane is not None or fp.lane_asked or self.notifier is None:
            return False
        peer = self.lanes.peer(m.registration.reg.agent_name)
        if peer is None or not peer.hello.fabric_host:
            return False
        fp.lane_asked = True
        try:  # this flow's bytes: with unequal TP sizes a part of either side's blocks
            nbytes = self.plans.whole(peer.hello, fp.block_ids, m.registration.reg)[2]
        except Exception:  # a plan that fails fails the push at start; ask for the blocks
            nbytes = len(m.registration.reg.block_ids) * sum(r.block_len for r in self.layout.regions)
        fp.reserved_bytes = nbytes
        self.asking[fp.key] = (m, time.monotonic())
        # this worker pair's flow only (with TP>1 every rank asks for its own)
        pair = self.lanes.worker_pair(peer.hello)
        scope = FlowScope(p_engine=pair.p_engine, d_engine=pair.d_engine, p_rank=pair.p_rank, d_rank=pair.d_rank)
        self.notifier.reserve(self.cfg.fabric_host, peer.hello.fabric_host, nbytes, transfer_id=fp.transfer_id,
                              scope=scope, done=lambda _tid, lane, lease, key=fp.key: self._put("reserved", (key, lane, lease)))
        return True

    def on_reserved(self, key: str, lane: int | None, lease_id: str | None) -> None:
        asked = self.asking.pop(key, None)
        if asked is None:  # too late: the push went on the hash's lane; free what was reserved
            if lease_id and self.notifier is not None:
                self.notifier.release(lease_id)
            return
        m = asked[0]
        m.prefill.lane, m.prefill.lease_id = lane, lease_id  # None: the hash's lane
        self.stats.inc("lanes_reserved_at_push" if lane is not None else "lanes_reserve_fallback")
        self.start(m)

    def stop_asking(self) -> None:
        """A push waits ASK_TIMEOUT_S at most for its lane, then goes on the hash's lane."""
        now = time.monotonic()
        for key, (m, at) in list(self.asking.items()):
            if now - at > ASK_TIMEOUT_S:
                del self.asking[key]
                self.stats.inc("lanes_reserve_fallback")
                self.start(m)

    def pump_queue(self) -> None:
        """Start the pushes whose turn at the uplink came (a slot, or their wait's bound)."""
        for m, overdue in self.queue.ready(time.monotonic()):
            if overdue:
                self.stats.inc("pushes_queue_overdue")
            try:
                self.start(m)
            except Exception as e:  # one that raises must not strand the others
                logger.exception("push %s could not start", m.prefill.transfer_id)
                self.fail(m, f"starting the push failed: {e}")

    def _admitted(self, m: Match) -> bool:
        """A whole push may post now (uplink_pushes: it holds a slot, or its wait ended);
        a layer-wise one always (its WRITEs follow the forward)."""
        fp = m.prefill
        if not self.queue.active or (fp.progress is not None and not fp.progress.final):
            return True
        nbytes = len(m.registration.reg.block_ids) * self.layout.bytes_per_block()  # (the order's estimate)
        waiting = self.queue.holds(fp.key)
        if self.queue.admit(m, nbytes, time.monotonic()):
            return True
        if not waiting:
            self.stats.inc("pushes_queued")
        return False

    def start(self, m: Match) -> None:
        if self._ask_lane(m) or not self._admitted(m):
            return
        fp, pr = m.prefill, m.registration
        reg = pr.reg
        n_lanes = self.cfg.lanes
        lane = fp.lane if fp.lane is not None and 0 <= fp.lane < n_lanes else default_lane(fp.transfer_id, n_lanes)
        peer = self.lanes.peers[reg.agent_name]
        rec = TransferRecord(
            transfer_id=fp.transfer_id, request_id=fp.request_id, peer_engine=peer.hello.engine_id,
            peer_request_id=reg.request_id, peer_rank=peer.hello.compat.tp_rank, lane=lane, lease_id=fp.lease_id or "",
            registered_at=pr.received_at, prefill_done_at=fp.finished_at,
            **(fp.times.record_fields() if fp.times is not None else {}),
        )
        if fp.progress is not None:
            final_times(fp.progress, rec)
            if fp.progress.aborted:
                self.fail(m, "P's request was aborted", rec)
                return
        if time.monotonic() >= pr.post_by:
            self.fail(m, "D's post_by deadline passed before the prefill finished", rec)
            return
        # (a prefill still computing has only its first chunks' blocks yet: its commit checks)
        early = fp.progress is not None and fp.progress.last_start is None and not fp.progress.final
        short = "" if early else self.plans.too_few_blocks(peer.hello, fp.block_ids, reg)
        if short:
            self.fail(m, short, rec)
            return
        try:
            if peer.lanes.lanes[lane].broken:
                live = [i for i, ln in enumerate(peer.lanes.lanes) if not ln.broken]
                if live:
                    # another lane carries this push now; the broken one reopens on the
                    # writer's loop (a blocking reopen would hold every other push)
                    self.lanes.queue_reopen(peer, lane)
                    lane = rec.lane = live[0]
                else:  # no lane open to D at all: the push waits for the reopen, on the loop
                    self._park(peer, lane, m, rec)
                    return
            agent = peer.lanes.agent(lane)
            rec.src_port = peer.lanes.lanes[lane].src_port
            rec.five_tuple = peer.lanes.lanes[lane].five_tuple()
            if fp.progress is not None and not fp.progress.final:  # layer-wise: its layers as they come
                self.layers.begin(m, peer, lane, agent, rec)
                return
            loc, rem, nbytes = self.plans.whole(peer.hello, fp.block_ids, reg)
            rec.bytes, rec.descriptors, rec.blocks = nbytes, len(loc), len(reg.block_ids)
            # kv_verify: a digest of the source bytes, from blocks held until the WRITE ends
            notif = (M.make_notif(fp.transfer_id) if self.kv_verify is None else self.kv_verify.p_notif(
                fp.transfer_id, self.layout, self.compat, peer.hello, fp.block_ids, reg, loc))
            rec.submit_at = time.time()
            h = None
            if len(loc) == 0:  # this rank writes no head of D's: the notification alone
                self.channel.ack(pr.reply_to, fp.transfer_id, "posted")
                agent.send_notif(reg.agent_name, notif)
            else:
                l_d = agent.get_xfer_descs(loc, self.layout.mem_type)
                r_d = agent.get_xfer_descs(rem, peer.hello.layout.mem_type)
                h = agent.initialize_xfer("WRITE", l_d, r_d, reg.agent_name, notif)
                rec.writes = 1
        except Exception as e:  # nothing was posted
            self.fail(m, f"preparing the WRITE failed: {e}", rec)
            return
        if h is None:  # outside the try: an error in it must not fail a push that ended
            rec.completed_at = time.time()
            self.succeed(m, rec)
            return
        # D: progress fast now (and a WRITE is posted: no "never posted" answer ends it)
        self.channel.ack(pr.reply_to, fp.transfer_id, "posted", nbytes=nbytes)
        try:
            state = agent.transfer(h)
        except Exception as e:
            state = "ERR"
            logger.warning("posting the WRITE of %s raised: %s", fp.transfer_id, e)
        f = InFlight(m, lane, agent, [(h, nbytes)], rec, time.monotonic() + self.cfg.transfer_timeout_s,
                     lane_obj=peer.lanes.lanes[lane])
        if state == "ERR":
            self.failed_write(f, "NIXL refused the WRITE")
            return
        self.in_flight[fp.key] = f
        if state == "DONE":
            self.progress()

    def progress(self) -> None:
        now = time.monotonic()
        for key, f in list(self.in_flight.items()):
            for h, nbytes in list(f.handles):
                try:
                    state = f.agent.check_xfer_state(h)
                except Exception as e:  # the peer vanished under the transfer
                    state, why = "ERR", str(e)
                else:
                    why = "transfer error"
                if state == "PROC":
                    if not f.slow and now > f.slow_at:
                        f.slow = True
                        self.stats.inc("pushes_slow")
                        logger.warning("push %s still running after %.1fs; waiting for UCX to finish or fail it",
                                       f.match.prefill.transfer_id, self.cfg.transfer_timeout_s)
                    continue
                f.handles.remove((h, nbytes))
                self._release(f, h)
                if state != "DONE":
                    # a failed WRITE no longer reads P's blocks; the flow's others may: it
                    # ends when they have ended
                    f.failing, f.errored = f.failing or why, True
                elif f.layered:
                    f.done_bytes += nbytes
                    if f.match.prefill.progress.forward_end_at is None:
                        f.record.overlap_bytes += nbytes  # landed before P's prefill ended
            if f.handles:
                continue
            if f.layered:
                self.layers.next(f)
            elif f.errored:
                self.failed_write(f, f.failing)
            else:
                del self.in_flight[key]
                f.record.completed_at = time.time()
                self.succeed(f.match, f.record)

    def _release(self, f: InFlight, h: Any) -> None:
        try:
            f.agent.release_xfer_handle(h)
        except Exception:
            logger.debug("releasing handle of %s failed", f.match.prefill.transfer_id, exc_info=True)

    def failed_write(self, f: InFlight, why: str) -> None:
        """UCX reported a WRITE failed: it no longer reads the source blocks, and its
        connection is broken. The lane is reopened on its next use. Called once none of
        the flow's WRITEs is in flight."""
        self.in_flight.pop(f.match.prefill.key, None)
        for h, _ in f.handles:  # none in flight: NIXL refused the one just posted
            self._release(f, h)
        f.handles.clear()
        peer = self.lanes.peer(f.match.registration.reg.agent_name)
        # the lane it was posted on, not one reopened under the same index since
        if peer is not None and (f.lane_obj is None or peer.lanes.lanes[f.lane] is f.lane_obj):
            peer.lanes.tear_down(f.lane)
            self.stats.inc("lanes_torn_down")
        self.fail(f.match, why, f.record, posted=True)

    def advance(self) -> None:
        """Layers were computed or a request ended: post what is ready, commit what is done."""
        self.layers.advance()

    def succeed(self, m: Match, rec: TransferRecord) -> None:
        share = m.prefill.share
        if self.kv_dump is not None and (share is None or share.left == 1):  # once, before the blocks are freed
            self.kv_dump.write(m.prefill.transfer_id, self.layout, self.compat, m.prefill.block_ids)
        self.state.complete(m.prefill.key, "ok")
        self.queue.done(m.prefill.key)
        self.freed.release(m.prefill)
        self.stats.inc("pushes_ok")
        self.stats.observe_transfer(rec)
        self._record(rec)
        logger.debug("pushed %s: %d B in %d descs on lane %d", rec.transfer_id, rec.bytes, rec.descriptors, rec.lane)

    def fail(self, m: Match, why: str, rec: TransferRecord | None = None, posted: bool = False) -> None:
        tid = m.prefill.transfer_id
        self.state.active.setdefault(m.prefill.key, m)
        self.state.complete(m.prefill.key, "failed", posted)  # what a later Cancel is answered with
        self.queue.done(m.prefill.key)
        self.freed.release(m.prefill)
        self.stats.inc("pushes_failed")
        rec = rec or TransferRecord(tid, m.prefill.request_id)
        rec.status, rec.detail, rec.completed_at = "failed", why, time.time()
        self._record(rec)
        logger.warning("push %s failed: %s", tid, why)
        self.channel.ack(m.registration.reply_to, tid, "failed", why, posted)

    def expire(self) -> None:
        self.advance()  # a layer-wise flow past D's post_by fails
        for m, rec in self.parked.expire(time.monotonic()):
            try:
                self.fail(m, "D's post_by deadline passed while its lane reopened", rec)
            except Exception:
                logger.exception("failing push %s failed", m.prefill.transfer_id)
        ex = self.state.expire()
        # each one on its own: a failure on one (already popped from the state) must not
        # strand the blocks or the answers of the others
        for fp in ex.prefills:
            try:
                self.freed.release(fp)
                self.stats.inc("pushes_expired")
                self._record(
                    TransferRecord(fp.transfer_id, fp.request_id, status="expired", prefill_done_at=fp.finished_at,
                                   detail=f"no registration within {self.cfg.lease_timeout_s}s")
                )
                logger.warning("lease of %s expired: D never registered; blocks freed", fp.transfer_id)
            except Exception:
                self.stats.inc("engine_thread_errors")
                logger.exception("expiring %s failed", fp.transfer_id)
        for pr in ex.registrations:
            try:
                self.stats.inc("registrations_rejected")
                self.channel.ack(pr.reply_to, pr.reg.transfer_id, "expired", "no matching prefill finished in time")
            except Exception:
                self.stats.inc("engine_thread_errors")
                logger.exception("answering the expiry of %s failed", pr.reg.transfer_id)

    # -- pushes waiting for a lane (parked) ---------------------------------------
    def _park(self, peer: Peer, lane: int, m: Match, rec: TransferRecord) -> None:
        """A push to a D with no lane open: queue lane ``lane``'s reopen and wait for it."""
        name = peer.hello.agent_name
        self.queue.done(m.prefill.key)  # its uplink slot goes to another push while the lane reopens
        if not self.lanes.queue_reopen(peer, lane) and name not in self.parked:
            self.fail(m, f"no lane to D is open and {MAX_QUEUED_SETUPS} lane set-ups are queued", rec)
            return
        self.parked.add(name, m, rec)

    def reopen_ended(self, name: str, why: str | None) -> None:
        """A lane reopen to D ``name`` ended (``why``: it failed). Its waiting pushes go on
        when a lane to D is open now; when none is, they fail, and the D's other queued
        reopens are dropped (D is unreachable: each would spend its own probe timeout)."""
        if name not in self.parked:
            return
        peer = self.lanes.peer(name)
        if peer is not None and any(not ln.broken for ln in peer.lanes.lanes):
            self._unpark(name, None)
            return
        self.lanes.drop_reopens_of(name)
        self._unpark(name, why or "no lane to D could be reopened")

    def _unpark(self, name: str, why: str | None) -> None:
        """Start D ``name``'s waiting pushes (``why`` None), or fail them with ``why``.
        Each on its own: one that raises is failed and strands none of the others."""
        for m, rec in self.parked.pop(name):
            try:
                if why is None:
                    self.start(m)
                else:
                    self.fail(m, why, rec)
            except Exception as e:
                logger.exception("push %s waiting for a lane could not go on", m.prefill.transfer_id)
                try:
                    self.fail(m, f"resuming the push failed: {e}", rec)
                except Exception:
                    logger.exception("failing push %s failed", m.prefill.transfer_id)

    def cancel_parked(self, key: str) -> bool:
        """D's Cancel of a push (flow ``key``) waiting for a lane or for its uplink slot, or
        of a layer-wise one that has posted nothing yet: it ends "cancelled", not posted,
        its blocks freed (for a request still computing: when it ends). False when none."""
        f = self.in_flight.get(key)
        queued = self.queue.take(key)
        if f is not None and f.layered and f.record.writes == 0 and not f.handles:
            del self.in_flight[key]
            got = (f.match, f.record)
        elif queued is not None:
            got = (queued, TransferRecord(queued.prefill.transfer_id, queued.prefill.request_id))
        else:
            got = self.parked.take(key)
        if got is None:
            return False
        m, rec = got
        tid = m.prefill.transfer_id
        self.state.complete(key, "cancelled", posted=False)
        self.queue.done(key)
        self.freed.release(m.prefill)
        self.stats.inc("pushes_cancelled")
        why = "cancelled before its WRITE was posted"
        rec.status, rec.detail, rec.completed_at = "cancelled", why, time.time()
        self._record(rec)
        self.channel.ack(m.registration.reply_to, tid, "cancelled", why, False)
        return True

    def drop_all(self) -> None:
        """Shutdown: WRITEs in flight are released (nobody will complete them), waiting
        pushes fail."""
        for f in list(self.in_flight.values()):
            for h, _ in f.handles:
                self._release(f, h)
        self.in_flight.clear()
        for name in self.parked.names():
            self._unpark(name, "P is shutting down")
        for m in self.queue.drop_all():
            try:
                self.fail(m, "P is shutting down")
            except Exception:
                logger.exception("failing push %s failed", m.prefill.transfer_id)
