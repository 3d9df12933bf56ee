"""P's write loop: a matched push (finished prefill + D's registration) gets its lane
(given, asked of the reservation service at push time, or the hash's), its WRITE is
posted on that lane's agent and progressed until NIXL says done or failed; then the
blocks are freed, the reservation ended, D told, and the transfer record written.
Every method runs on the writer thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpath.connector import messages as M
from kvpath.connector.config import RESERVE_AT_PUSH
from kvpath.connector.kv_verify import tokens_written
from kvpath.connector.layout import build_descs
from kvpath.connector.push_state import FinishedPrefill, Match
from kvpath.connector.tp_map import plan, rank_kv
from kvpath.reservation.decisions import default_lane
from kvpath.reservation.wire import FlowScope
from kvpath.trace import TransferRecord

if TYPE_CHECKING:
    from kvpath.connector.sender import PushSender

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 0.05  # reserve_at=push: how long a push waits for its lane


@dataclass
class InFlight:
    match: Match
    lane: int
    agent: Any
    handle: Any
    record: TransferRecord
    slow_at: float  # transfer_timeout_s after posting: logged and counted, not abandoned
    slow: bool = False  # past slow_at: progressed every millisecond, no longer in a busy loop
    lane_obj: Any = None  # the Lane it was posted on (a reopened lane is another object)


class WriteLoop:
    """The WRITE half of :class:`~kvpath.connector.sender.PushSender` (a mixin: the
    state is the sender's, this groups the code that posts and completes pushes)."""

    def _ask_lane(self: "PushSender", m: Match) -> bool:
        """reserve_at=push: ask the reservation service for this push's lane first (on
        the notifier's thread); the WRITE starts when the answer comes. False when
        there is nothing to ask (a lane was given, no service, hosts unknown)."""
        fp = m.prefill
        if self.cfg.reserve_at != RESERVE_AT_PUSH or fp.lane is not None or fp.lane_asked or self.notifier is None:
            return False
        peer = self._peers.get(m.registration.reg.agent_name)
        if peer is None or not peer.hello.fabric_host:
            return False
        fp.lane_asked = True
        try:  # this flow's bytes: with unequal TP sizes a part of either side's blocks
            nbytes = self._descs(peer.hello, fp.block_ids, m.registration.reg)[2]
        except Exception:  # a plan that fails fails the push at _start_write; ask for the blocks
            nbytes = len(m.registration.reg.block_ids) * sum(r.block_len for r in self.layout.regions)
        self._asking[fp.key] = (m, time.monotonic())
        # this worker pair's flow only (with TP>1 every rank asks for its own)
        pair = self.worker_pair(peer.hello)
        scope = FlowScope(p_engine=pair.p_engine, d_engine=pair.d_engine, p_rank=pair.p_rank, d_rank=pair.d_rank)
        self.notifier.reserve(self.cfg.fabric_host, peer.hello.fabric_host, nbytes, transfer_id=fp.transfer_id,
                              scope=scope, done=lambda _tid, lane, lease, key=fp.key: self._put("reserved", (key, lane, lease)))
        return True

    def _on_reserved(self: "PushSender", key: str, lane: int | None, lease_id: str | None) -> None:
        asked = self._asking.pop(key, None)
        if asked is None:  # too late: the push went on the hash's lane; free what was reserved
            if lease_id and self.notifier is not None:
                self.notifier.release(lease_id)
            return
        m = asked[0]
        m.prefill.lane, m.prefill.lease_id = lane, lease_id  # None: the hash's lane
        self.stats.inc("lanes_reserved_at_push" if lane is not None else "lanes_reserve_fallback")
        self._start_write(m)

    def _stop_asking(self: "PushSender") -> None:
        """A push waits ASK_TIMEOUT_S at most for its lane, then goes on the hash's lane."""
        now = time.monotonic()
        for key, (m, at) in list(self._asking.items()):
            if now - at > ASK_TIMEOUT_S:
                del self._asking[key]
                self.stats.inc("lanes_reserve_fallback")
                self._start_write(m)

    def _start_write(self: "PushSender", m: Match) -> None:
        if self._ask_lane(m):
            return
        fp, pr = m.prefill, m.registration
        reg = pr.reg
        n_lanes = self.cfg.lanes
        lane = fp.lane if fp.lane is not None and 0 <= fp.lane < n_lanes else default_lane(fp.transfer_id, n_lanes)
        peer = self._peers[reg.agent_name]
        rec = TransferRecord(
            transfer_id=fp.transfer_id, request_id=fp.request_id, peer_engine=peer.hello.engine_id,
            peer_request_id=reg.request_id, peer_rank=peer.hello.compat.tp_rank, lane=lane, lease_id=fp.lease_id or "",
            registered_at=pr.received_at, prefill_done_at=fp.finished_at,
            **(fp.times.record_fields() if fp.times is not None else {}),
        )
        if time.monotonic() >= pr.post_by:
            self._fail(m, "D's post_by deadline passed before the prefill finished", rec)
            return
        short = self._too_few_blocks(peer.hello, fp.block_ids, reg)
        if short:
            self._fail(m, short, rec)
            return
        try:
            if peer.lanes.lanes[lane].broken:
                live = [i for i, ln in enumerate(peer.lanes.lanes) if not ln.broken]
                if live:
                    # another lane carries this push now; the broken one reopens on the
                    # writer's loop (a blocking reopen would hold every other push)
                    self._queue_lane_reopen(peer, lane)
                    lane = rec.lane = live[0]
                else:  # no lane open to D at all: the push waits for the reopen, on the loop
                    self._park(peer, lane, m, rec)
                    return
            agent = peer.lanes.agent(lane)
            rec.src_port = peer.lanes.lanes[lane].src_port
            rec.five_tuple = peer.lanes.lanes[lane].five_tuple()
            loc, rem, nbytes = self._descs(peer.hello, fp.block_ids, reg)
            rec.bytes, rec.descriptors, rec.blocks = nbytes, len(loc), len(reg.block_ids)
            # kv_verify: a digest of the source bytes, from blocks held until the WRITE ends
            notif = (M.make_notif(fp.transfer_id) if self.kv_verify is None else self.kv_verify.p_notif(
                fp.transfer_id, self.layout, self.compat, peer.hello, fp.block_ids, reg, loc))
            rec.submit_at = time.time()
            h = None
            if len(loc) == 0:  # this rank writes no head of D's: the notification alone
                self._send(pr.reply_to, M.Ack(fp.transfer_id, "posted", instance=self.instance))
                agent.send_notif(reg.agent_name, notif)
            else:
                l_d = agent.get_xfer_descs(loc, self.layout.mem_type)
                r_d = agent.get_xfer_descs(rem, peer.hello.layout.mem_type)
                h = agent.initialize_xfer("WRITE", l_d, r_d, reg.agent_name, notif)
        except Exception as e:  # nothing was posted
            self._fail(m, f"preparing the WRITE failed: {e}", rec)
            return
        if h is None:  # outside the try: an error in it must not fail a push that ended
            rec.completed_at = time.time()
            self._succeed(m, rec)
            return
        # D: progress fast now (and a WRITE is posted: no "never posted" answer ends it)
        self._send(pr.reply_to, M.Ack(fp.transfer_id, "posted", bytes=nbytes, instance=self.instance))
        try:
            state = agent.transfer(h)
        except Exception as e:
            state = "ERR"
            logger.warning("posting the WRITE of %s raised: %s", fp.transfer_id, e)
        f = InFlight(m, lane, agent, h, rec, time.monotonic() + self.cfg.transfer_timeout_s,
                     lane_obj=peer.lanes.lanes[lane])
        if state == "ERR":
            self._failed_write(f, "NIXL refused the WRITE")
            return
        self._inflight[fp.key] = f
        if state == "DONE":
            self._progress()

    def _descs(self: "PushSender", hello: M.Hello, p_blocks: list[int], reg: M.Register
               ) -> tuple[np.ndarray, np.ndarray, int]:
        """The WRITE's descriptors: blocks as they are at equal sizes; else the heads this
        rank holds that D's rank needs, each at its offset in D's blocks (tp_map.plan)."""
        src = p_blocks[reg.skip_blocks : reg.skip_blocks + len(reg.block_ids)]
        if self.same_sizes(hello):
            return build_descs(self.layout, hello.layout, src, reg.block_ids)
        d_bs = hello.layout.block_size
        # The tokens both sides' blocks hold: past the prompt's last token they are the
        # last blocks' unused rows (decode's, on D), never another request's block.
        n = tokens_written(self.layout.block_size, len(p_blocks), d_bs, reg.skip_blocks + len(reg.block_ids))
        # D's skipped blocks (its prefix hits) are not written: placeholders, never read
        return plan(rank_kv(self.layout, self.compat), rank_kv(hello.layout, hello.compat), None, p_blocks,
                    [0] * reg.skip_blocks + list(reg.block_ids), n, reg.skip_blocks * d_bs)

    def _too_few_blocks(self: "PushSender", hello: M.Hello, p_blocks: list[int], reg: M.Register) -> str:
        """Why P's blocks cannot fill D's (another prompt length), or "": at equal block
        sizes P has a block for each of D's; else P's tokens reach into D's last block."""
        d_blocks = reg.skip_blocks + len(reg.block_ids)
        p_bs, d_bs = self.layout.block_size, hello.layout.block_size
        if p_bs == d_bs:
            ok = len(p_blocks) >= d_blocks
        else:
            ok = len(p_blocks) * p_bs > (d_blocks - 1) * d_bs
        return "" if ok else (f"P has {len(p_blocks)} blocks of {p_bs} tokens, D expects {d_blocks} blocks of "
                              f"{d_bs} tokens")

    def _progress(self: "PushSender") -> None:
        now = time.monotonic()
        for key, f in list(self._inflight.items()):
            try:
                state = f.agent.check_xfer_state(f.handle)
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
            del self._inflight[key]
            if state == "DONE":
                self._release_handle(f)
                f.record.completed_at = time.time()
                self._succeed(f.match, f.record)
            else:
                self._failed_write(f, why)

    def _release_handle(self: "PushSender", f: InFlight) -> None:
        try:
            f.agent.release_xfer_handle(f.handle)
        except Exception:
            logger.debug("releasing handle of %s failed", f.match.prefill.transfer_id, exc_info=True)

    def _failed_write(self: "PushSender", f: InFlight, why: str) -> None:
        """UCX reported the WRITE failed: it no longer reads the source blocks, and its
        connection is broken. The lane is reopened on its next use."""
        self._inflight.pop(f.match.prefill.key, None)
        self._release_handle(f)
        peer = self._peers.get(f.match.registration.reg.agent_name)
        # the lane it was posted on, not one reopened under the same index since
        if peer is not None and (f.lane_obj is None or peer.lanes.lanes[f.lane] is f.lane_obj):
            peer.lanes.tear_down(f.lane)
            self.stats.inc("lanes_torn_down")
        self._fail(f.match, why, f.record, posted=True)

    def _succeed(self: "PushSender", m: Match, rec: TransferRecord) -> None:
        share = m.prefill.share
        if self.kv_dump is not None and (share is None or share.left == 1):  # once, before the blocks are freed
            self.kv_dump.write(m.prefill.transfer_id, self.layout, self.compat, m.prefill.block_ids)
        self.state.complete(m.prefill.key, "ok")
        self._release(m.prefill)
        self.stats.inc("pushes_ok")
        self.stats.observe_transfer(rec)
        self._record(rec)
        logger.debug("pushed %s: %d B in %d descs on lane %d", rec.transfer_id, rec.bytes, rec.descriptors, rec.lane)

    def _fail(self: "PushSender", m: Match, why: str, rec: TransferRecord | None = None, posted: bool = False) -> None:
        tid = m.prefill.transfer_id
        self.state.active.setdefault(m.prefill.key, m)
        self.state.complete(m.prefill.key, "failed", posted)  # what a later Cancel is answered with
        self._release(m.prefill)
        self.stats.inc("pushes_failed")
        rec = rec or TransferRecord(tid, m.prefill.request_id)
        rec.status, rec.detail, rec.completed_at = "failed", why, time.time()
        self._record(rec)
        logger.warning("push %s failed: %s", tid, why)
        self._ack(m.registration.reply_to, tid, "failed", why, posted)

    def _expire(self: "PushSender") -> None:
        if self._parked:
            self._expire_parked(time.monotonic())
        ex = self.state.expire()
        # each one on its own: a failure on one (already popped from the state) must not
        # strand the blocks or the answers of the others
        for fp in ex.prefills:
            try:
                self._release(fp)
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
                self._ack(pr.reply_to, pr.reg.transfer_id, "expired", "no matching prefill finished in time")
            except Exception:
                self.stats.inc("engine_thread_errors")
                logger.exception("answering the expiry of %s failed", pr.reg.transfer_id)

    def _release(self: "PushSender", fp: FinishedPrefill) -> None:
        """The push of flow ``fp`` ended (any way): end the reservation asked for it; at
        the prefill's last flow free its blocks and end the reservation it came with."""
        last = self.state.flow_ended(fp)
        if fp.lane_asked and fp.lease_id and self.notifier is not None:  # this flow's own
            try:
                self.notifier.release(fp.lease_id)
            except Exception:
                logger.exception("releasing the reservation of %s failed", fp.transfer_id)
        if not last:
            return
        request_id = fp.request_id
        # Report each request once: vLLM frees (and forgets) it on the first report.
        if request_id not in self._released:
            self._released[request_id] = None
            if len(self._released) > 65536:
                self._released.popitem(last=False)
            with self._finished_lock:
                self._finished.add(request_id)
            self.results_ready.set()
        if fp.lease_id and not fp.lane_asked and self.notifier is not None:  # after the blocks: it must not keep them
            try:
                self.notifier.release(fp.lease_id)
            except Exception:
                logger.exception("releasing the reservation of %s failed", fp.transfer_id)
