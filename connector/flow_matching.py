"""P's flows: finished prefills (from the engine) matched with D's registrations (from
the control channel), one flow per D rank a prefill's heads go to. A Register is checked
against its D worker (its blocks, P's bounds, the TP sizes, its deadline) before it
waits; a Cancel ends only a flow its own D registered; a match starts a push on the
write loop. The bookkeeping is :class:`~kvpath.connector.push_state.SenderState`
(pure); this part answers D and frees blocks. Writer thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvpath.connector import messages as M
from kvpath.connector.control_channel import ControlChannel
from kvpath.connector.freed_blocks import FreedBlocks
from kvpath.connector.lane_setup import LaneSetup
from kvpath.connector.push_state import (MAX_WAITING_PER_PEER, MAX_WAITING_REGISTRATIONS, FinishedPrefill, Match,
                                         SenderState, flow_key)
from kvpath.connector.telemetry import Stats
from kvpath.connector.tp_map import d_ranks_of
from kvpath.connector.write_loop import WriteLoop
from kvpath.trace import TransferRecord

logger = logging.getLogger(__name__)

MAX_BEGUN = 65536  # layer-wise prefills computing at once (the engine's running requests bound it)


class FlowMatching:
    """What P does with a finished prefill, a Register, a Cancel and an abort."""

    def __init__(self, compat: M.Compat, state: SenderState, stats: Stats, channel: ControlChannel,
                 lanes: LaneSetup, writes: WriteLoop, freed: FreedBlocks, record: Callable[[Any], None]):
        self.compat, self.state, self.stats = compat, state, stats
        self.channel, self.lanes, self.writes, self.freed = channel, lanes, writes, freed
        self._record = record
        self.next_heartbeat = 0.0  # monotonic time of the next Pending heartbeat
        # transfer id -> a layer-wise prefill still computing (until its request finishes
        # or is aborted: the engine reports one or the other for each)
        self.begun: dict[str, FinishedPrefill] = {}

    def can_begin(self, fp: FinishedPrefill) -> bool:
        """A begun prefill is tracked unless its transfer id is begun already (a request
        reusing a live one's id) or MAX_BEGUN are: such a request goes whole when it ends,
        and its abort frees its blocks at once (nothing reads them)."""
        if fp.transfer_id in self.begun or len(self.begun) >= MAX_BEGUN:
            logger.warning("request %s: transfer %s not pushed layer-wise (%s): pushed whole when it ends",
                           fp.request_id, fp.transfer_id,
                           "its id is begun already" if fp.transfer_id in self.begun else f"{MAX_BEGUN} are begun")
            return False
        return True

    def on_begin(self, fp: FinishedPrefill) -> None:
        """A layer-wise prefill began its last forward: it waits for (or matches) D's
        registration as a finished one does; its flows push layers as they come."""
        self.begun[fp.transfer_id] = fp
        self.on_finished(fp, begun=True)

    def on_feed(self, b: FinishedPrefill, fp: FinishedPrefill) -> None:
        """The next forward of begun prefill ``b`` (chunk-wise): its blocks so far, in place
        (its flows share the list), and what that forward makes final."""
        b.block_ids[:] = fp.block_ids
        p = fp.progress
        b.progress.feed(p.forward, p.tokens_final, p.final_after)

    def on_restart(self, transfer_id: str, request_id: str) -> FinishedPrefill | None:
        """vLLM preempted begun request ``request_id``: its flows push anew, from its new
        blocks, once their WRITEs in flight have ended (they read freed blocks: what they
        land in D's blocks is written again before the commit)."""
        b = self.begun.get(transfer_id)
        if b is None or b.request_id != request_id:
            return None
        b.progress.restart()
        self.stats.inc("layer_restarts")
        self.writes.advance()
        return b

    def on_finished(self, fp: FinishedPrefill, begun: bool = False) -> None:
        b = None if begun else self.begun.get(fp.transfer_id)
        if b is not None and b.request_id == fp.request_id:
            # a layer-wise prefill's request finished: its KV is final, its flows may commit
            del self.begun[fp.transfer_id]
            p = b.progress
            p.final, p.done, p.finished_at, p.times = True, p.layers, fp.finished_at, fp.times
            if p.last_start is None:  # (an honest scheduler fed the last forward first)
                p.last_start = p.tokens_final
            self.state.renew_lease(fp.transfer_id)
            self.freed.request_ended(b)
            self.writes.advance()
            return
        status, matches = self.state.add_prefill(fp)
        if status == "duplicate":
            holder = self.state.holder(fp.transfer_id)
            if holder != fp.request_id:
                # Another P request already holds this transfer id (a reused id, n > 1):
                # this one's KV goes nowhere, so its blocks are freed now, not leaked.
                self.stats.inc("prefills_duplicate")
                logger.warning("request %s reuses transfer id %s held by request %s: its blocks are freed",
                               fp.request_id, fp.transfer_id, holder)
                self.freed.release(fp)
        elif status == "dead":
            logger.info("transfer %s already ended (%s): blocks freed", fp.transfer_id,
                        self.state.status_of(fp.transfer_id))
            self.freed.release(fp)
        elif status == "refused":
            self.refuse_prefill(fp)
        for m in matches:
            if self.state.active.get(m.prefill.key) is not m:
                # a registration without the transfer's key: the flow's prefill waits on
                self.refuse_key(m.registration.reply_to, fp.transfer_id)
                continue
            self.start_matched(m)  # each flow on its own: one that raises must not strand its siblings

    def on_abort(self, transfer_id: str, request_id: str | None = None) -> None:
        """P's request ended without KV to push. ``request_id``: a begun (layer-wise) one."""
        b = self.begun.get(transfer_id)
        if request_id is not None and (b is None or b.request_id != request_id):
            # begun on the scheduler, never here (its id was taken): nothing read its blocks
            self.freed.report(request_id)
            if b is not None:
                return  # the id is another live request's: its flows are not this abort's
        elif request_id is not None:  # a layer-wise prefill: no more WRITEs; its posted ones end first
            del self.begun[transfer_id]
            b.progress.aborted = True
            for fp in self.state.take_begun(transfer_id):
                self.freed.release(fp)
            self.freed.request_ended(b)
            self.writes.advance()
        for pr in self.state.abort_prefill(transfer_id):
            self.channel.ack(pr.reply_to, transfer_id, "rejected", "prefill request was aborted")

    def start_matched(self, m: Match) -> None:
        """Start a matched flow's push; a push that raises before anything was posted or
        queued fails cleanly (its blocks freed, D answered), never strands the match."""
        try:
            self.writes.start(m)
        except Exception as e:
            self.stats.inc("engine_thread_errors")
            logger.exception("starting push %s failed", m.prefill.transfer_id)
            key = m.prefill.key
            if self.state.active.get(key) is m and not self.writes.holds(key):  # nothing posted, nothing pending
                self.writes.fail(m, f"starting the push failed: {e}")

    def on_register(self, ident: bytes, reg: M.Register) -> None:
        self.stats.inc("registrations")
        tid = reg.transfer_id
        peer = self.lanes.peer(reg.agent_name)
        if peer is None:  # no handshake with this D (P restarted since): D says Hello again
            self.channel.ack(ident, tid, "unknown_peer", "no handshake with this D worker")
            return
        if peer.ident != ident:  # the agent's handshake came over another key's connection
            self.stats.inc("messages_unbound")
            logger.warning("dropped a registration for agent %s from another connection", reg.agent_name)
            return
        peer.last_seen = time.monotonic()
        bad = [b for b in reg.block_ids if b >= peer.hello.layout.num_blocks]
        if bad:
            self.stats.inc("registrations_rejected")
            self.channel.ack(ident, tid, "rejected", f"block id {bad[0]} outside D's {peer.hello.layout.num_blocks} blocks")
            return
        if reg.skip_blocks + len(reg.block_ids) > peer.hello.layout.num_blocks:
            self.stats.inc("registrations_rejected")
            self.channel.ack(ident, tid, "rejected", f"skip_blocks {reg.skip_blocks} + {len(reg.block_ids)} blocks exceed "
                                              f"D's {peer.hello.layout.num_blocks} blocks")
            return
        over = self._over_limit(ident, len(reg.block_ids), peer.hello.layout.num_blocks)
        if over:
            self.stats.inc("registrations_rejected")
            self.stats.inc("registrations_over_limit")
            logger.warning("registration of transfer %s from %s refused: %s", tid, reg.agent_name, over)
            self.channel.ack(ident, tid, "rejected", over)
            return
        want_tp = reg.p_tp_size or peer.hello.compat.tp_size
        if want_tp != self.compat.tp_size:
            # D chose which P ranks to register with for another TP size: the heads it
            # expects from this rank are not the ones this rank holds
            self.stats.inc("registrations_rejected")
            why = (f"p_tp_size: D chose its P ranks for P TP={want_tp}, this P has TP={self.compat.tp_size}; give D "
                   f"P's TP size (kvpath.tp_size in the D leg's kv_transfer_params, the proxy's tp= field of --prefill)")
            logger.warning("registration of transfer %s rejected: %s", tid, why)
            self.channel.ack(ident, tid, "rejected", why)
            return
        # D's deadlines, moved onto this clock. The message's age (wall clocks) is
        # taken off, so a Register that sat in a queue gets no extra time.
        now = time.monotonic()
        age = max(0.0, time.time() - reg.sent_at) if reg.sent_at else 0.0
        post_by = now + reg.post_by_s - age
        if post_by <= now:
            self.stats.inc("registrations_rejected")
            self.channel.ack(ident, tid, "expired", f"registration arrived {age:.1f}s after it was sent")
            return
        try:
            fan = d_ranks_of(self.compat.tp_size, self.compat.tp_rank, peer.hello.compat.tp_size,
                             self.compat.kv_heads)
        except ValueError:  # sizes the handshake would have refused
            fan = ()
        d_rank = peer.hello.compat.tp_rank
        if d_rank not in fan:  # D chose this P rank for heads it does not write to that D rank
            self.stats.inc("registrations_rejected")
            self.channel.ack(ident, tid, "rejected", f"P rank {self.compat.tp_rank} writes nothing to D rank {d_rank} "
                                              f"(P TP={self.compat.tp_size}, D TP={peer.hello.compat.tp_size})")
            return
        d_tp = peer.hello.compat.tp_size
        key = flow_key(tid, d_rank, len(fan), d_tp)
        siblings = tuple(flow_key(tid, d, len(fan), d_tp) for d in fan)
        status, m = self.state.add_registration(reg, ident, post_by, key, siblings)
        for fp in self.state.take_refused():
            self.refuse_prefill(fp)
        if status == "duplicate":
            self.stats.inc("registrations_duplicate")
            logger.warning("registration of %s for transfer %s rejected: the transfer id is taken (state %s)",
                           reg.request_id, tid, self.state.status_of(key) or "pending")
            self.channel.ack(ident, tid, "rejected", "transfer id already registered by another request")
            return
        if status == "aborted":
            self.stats.inc("registrations_rejected")
            self.channel.ack(ident, tid, "rejected", "prefill request was aborted")
            return
        if status == "key_mismatch":
            self.refuse_key(ident, tid)
            return
        self.channel.ack(ident, tid, "accepted")
        if m is not None:
            self.start_matched(m)

    def _over_limit(self, ident: bytes, blocks: int, num_blocks: int) -> str:
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

    def _flow_of(self, ident: bytes, tid: str) -> str:
        """The key of the flow of ``tid`` that the D worker behind ``ident`` registers."""
        peer = self.lanes.peer_of(ident)
        if peer is None:
            return tid
        c = peer.hello.compat
        try:
            fan = d_ranks_of(self.compat.tp_size, self.compat.tp_rank, c.tp_size, self.compat.kv_heads)
        except ValueError:  # sizes the handshake refused
            return tid
        return flow_key(tid, c.tp_rank, len(fan), c.tp_size) if c.tp_rank in fan else tid

    def on_cancel(self, ident: bytes, tid: str) -> None:
        key = self._flow_of(ident, tid)
        holder = self.state.registered_by(key)
        if holder is not None and holder != ident:  # only the D that registered it may cancel it
            self.stats.inc("messages_unbound")
            logger.warning("dropped a Cancel of transfer %s from a D that did not register it", tid)
            return
        status, fp, _ = self.state.cancel(key, ident)
        if status == "in_flight":
            self.writes.cancel_parked(key)  # one waiting for a lane has posted nothing: it ends now
            return  # else D hears the completion notification or a failure
        if status == "unregistered":  # this sender has nothing to cancel: nothing is touched
            self.channel.ack(ident, tid, "cancelled", "not registered", False)
            return
        if fp is not None:
            self.freed.release(fp)
            self.stats.inc("pushes_cancelled")
            self._record(TransferRecord(tid, fp.request_id, status="cancelled", prefill_done_at=fp.finished_at))
        # A transfer that had ended is answered with its record (a posted WRITE stays
        # posted: D keeps its fence); one this process never saw is now recorded as
        # cancelled, and D weighs that answer by our instance.
        final, posted = self.state.final(key) or ("cancelled", False)
        self.channel.ack(ident, tid, final, "already ended" if status == "done" else "", posted)

    def refuse_key(self, ident: bytes, tid: str) -> None:
        """A registration without the transfer's key (someone who learned only its id)."""
        self.stats.inc("registrations_rejected")
        self.stats.inc("transfer_key_mismatch")
        logger.warning("registration of transfer %s refused: it does not carry the transfer's key", tid)
        self.channel.ack(ident, tid, "rejected", "the registration does not carry the transfer's key")

    def refuse_prefill(self, fp: FinishedPrefill) -> None:
        """A P request without a transfer key named a transfer whose registration carries
        one: its KV goes nowhere (never into that D's blocks) and its blocks are freed."""
        self.stats.inc("transfer_key_mismatch")
        self.stats.inc("prefills_refused")
        logger.warning("request %s names transfer %s without its key: its KV is not pushed, its blocks are freed",
                       fp.request_id, fp.transfer_id)
        self.freed.release(fp)
        self._record(TransferRecord(fp.transfer_id, fp.request_id, status="rejected", prefill_done_at=fp.finished_at,
                                    detail="the request does not carry the transfer's key"))

    def heartbeat(self) -> None:
        """Tell each D that P still holds its registrations (so D's clock measures
        P's liveness, not P's queue)."""
        by_ident: dict[bytes, list[str]] = {}
        for pr in self.state.held_registrations():
            by_ident.setdefault(pr.reply_to, []).append(pr.reg.transfer_id)
        for ident, tids in by_ident.items():
            self.channel.send(ident, M.Pending(tids))
        self.next_heartbeat = time.monotonic() + self.lanes.heartbeat_s()
