"""P's layer-wise pushes (``push_granularity: layer``): a flow whose prefill is still
computing posts one WRITE per batch of layer groups computed, without a notification,
and commits (the completion notification) when every WRITE has ended and the request has
finished; it fails, as posted when anything was, on an abort or D's post_by. A part of
:class:`~kvpath.connector.write_loop.WriteLoop`, whose flows (``in_flight``) and ends
(``fail``, ``failed_write``, ``succeed``) it uses. :class:`InFlight`, a flow's posted
WRITEs (one for a whole push), is here because both parts make them. Writer thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvpath.connector import messages as M
from kvpath.connector.lane_setup import Peer
from kvpath.connector.push_state import Match
from kvpath.reservation.wire import MAX_EXPECTED_END_S
from kvpath.trace import TransferRecord

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A flow's posted WRITEs: one for a whole push; for a layer-wise push, those of its
    layer groups not yet done (none while it waits for layers)."""

    match: Match
    lane: int
    agent: Any
    handles: list[tuple[Any, int]]  # (NIXL handle, its bytes)
    record: TransferRecord
    slow_at: float  # transfer_timeout_s after posting: logged and counted, not abandoned
    slow: bool = False  # past slow_at: progressed every millisecond, no longer in a busy loop
    lane_obj: Any = None  # the Lane it was posted on (a reopened lane is another object)
    layered: bool = False  # a layer-wise push: WRITEs per layer group, then the commit
    sent: int = 0  # layer-wise: the last forward's layers posted
    total_bytes: int = 0  # layer-wise: the whole push's bytes (D is told them when the first WRITE posts)
    sent_tokens: int = 0  # layer-wise: the tokens posted in every layer (earlier chunks)
    gen: int = 0  # layer-wise: the progress's restart it pushes for
    failing: str = ""  # layer-wise: why the flow fails once its posted WRITEs have ended
    errored: bool = False  # one of its WRITEs failed: the lane is torn down at the end
    done_bytes: int = 0  # layer-wise: bytes of its WRITEs that ended DONE (its pace)
    learned: bool = False  # layer-wise: its whole bytes are known (the last forward began)


class LayerWrites:
    """The layer-wise flows of a write loop (``loop``)."""

    def __init__(self, loop: Any):
        self.loop = loop

    def begin(self, m: Match, peer: Peer, lane: int, agent: Any, rec: TransferRecord) -> None:
        """A flow whose prefill is still computing: WRITEs follow its finished chunks and
        its last forward's layers (what is ready already in one catch-up WRITE), the
        commit its request's end."""
        fp, reg = m.prefill, m.registration.reg
        rec.blocks, rec.granularity = len(reg.block_ids), "layer"
        try:  # the push's bytes, for D's pace; a chunk-wise prefill has only its first blocks yet
            total = self.loop.plans.whole(peer.hello, fp.block_ids, reg)[2]
        except ValueError:
            total = (reg.skip_blocks + len(reg.block_ids)) * self.loop.layout.bytes_per_block()
        f = InFlight(m, lane, agent, [], rec, float("inf"), lane_obj=peer.lanes.lanes[lane], layered=True,
                     total_bytes=total, gen=fp.progress.gen)
        self.loop.in_flight[fp.key] = f
        self.post(f)
        if not f.handles and f.sent == 0:
            self.next(f)  # the request may have ended already (aborted)

    def advance(self) -> None:
        """Layers or chunks were computed, a request ended or restarts: post what is ready,
        commit what is done."""
        for f in [f for f in self.loop.in_flight.values() if f.layered]:
            if f.handles:
                self.post(f)
            else:
                self.next(f)

    def post(self, f: InFlight) -> None:
        """Post the WRITEs of what is final and not yet posted: the tokens earlier chunks
        finished (every layer), then the last forward's layer groups computed."""
        m, p = f.match, f.match.prefill.progress
        if f.failing or p.aborted or f.gen != p.gen or self.loop.in_flight.get(m.prefill.key) is not f:
            return  # (a restarted push posts again once its WRITEs in flight have ended: next())
        if p.tokens_final > f.sent_tokens:
            if not self._write(f, (f.sent_tokens, p.tokens_final), (0, p.layers)):
                return
            f.sent_tokens = p.tokens_final
        if p.last_start is not None and not f.learned:
            self._learn(f)
        if p.last_start is None or f.sent_tokens < p.last_start:
            return
        group = self.loop.cfg.push_layer_group
        ready = p.done if p.done >= p.layers else p.done // group * group
        if ready > f.sent and self._write(f, (p.last_start, None), (f.sent, ready)):
            f.record.layers = f.sent = ready

    def _learn(self, f: InFlight) -> None:
        """The last forward began: every block of the prompt exists, so the push's whole
        bytes are known. A lane this flow reserved at its first layer (reserve_at push)
        learns them, and when the flow expects to end at its pace so far (its lease lasts
        past that: a push that began with the prefill holds its lane longer). A lease the
        proxy took covers every rank's flow; the proxy sized it from the prompt."""
        f.learned = True
        m = f.match
        fp, reg = m.prefill, m.registration.reg
        peer = self.loop.lanes.peer(reg.agent_name)
        try:  # exact now (the begin's estimate may count prefix hits and heads this rank does not write)
            if peer is not None:
                f.total_bytes = self.loop.plans.whole(peer.hello, fp.block_ids, reg)[2]
        except Exception as e:  # never into the writer's loop: the push itself goes on
            logger.debug("push %s: its whole bytes are not known (%s)", fp.transfer_id, e)
        notifier = self.loop.notifier
        if not (fp.lane_asked and fp.lease_id) or notifier is None:
            return
        expected = None
        if f.done_bytes > 0 and f.record.submit_at:
            pace = f.done_bytes / max(time.time() - f.record.submit_at, 1e-6)
            left = max(f.total_bytes - f.done_bytes, 0)
            expected = round(min(left / pace, MAX_EXPECTED_END_S), 3) if pace > 0 else None
        if expected is None and f.total_bytes == fp.reserved_bytes:
            return  # nothing the service does not know (a one-forward prompt: its reservation was exact)
        notifier.update(fp.lease_id, f.total_bytes, expected)
        self.loop.stats.inc("leases_updated")

    def _write(self, f: InFlight, tokens: tuple[int, int | None], layers: tuple[int, int]) -> bool:
        """One WRITE, without a notification, of ``layers`` of the prompt's ``tokens``.
        False when the flow fails instead (it ends once its WRITEs in flight have)."""
        m, p = f.match, f.match.prefill.progress
        pr, fp = m.registration, m.prefill
        if time.monotonic() >= pr.post_by:
            f.failing = "D's post_by deadline passed before the prefill finished"
            return False
        peer = self.loop.lanes.peer(pr.reg.agent_name)
        try:
            if peer is None:
                raise RuntimeError("D's handshake is gone")
            loc, rem, nbytes = self.loop.plans.layers(peer.hello, fp.block_ids, pr.reg, *layers, p.layers, tokens)
            if len(loc):
                l_d = f.agent.get_xfer_descs(loc, self.loop.layout.mem_type)
                r_d = f.agent.get_xfer_descs(rem, peer.hello.layout.mem_type)
                h = f.agent.initialize_xfer("WRITE", l_d, r_d, pr.reg.agent_name, b"")  # the commit notifies
                f.handles.append((h, nbytes))  # from here on released by progress(), whatever follows
                if f.record.writes == 0:  # D: progress fast now; the WRITEs' bytes in all
                    f.record.submit_at = time.time()
                    self.loop.channel.ack(pr.reply_to, fp.transfer_id, "posted", nbytes=f.total_bytes)
                f.record.writes += 1
                self.loop.stats.inc("layer_writes")
                if not f.slow:
                    f.slow_at = time.monotonic() + self.loop.cfg.transfer_timeout_s
                try:
                    state = f.agent.transfer(h)
                except Exception as e:
                    state = "ERR"
                    logger.warning("posting a layer WRITE of %s raised: %s", fp.transfer_id, e)
                if state == "ERR":
                    f.failing, f.errored = "NIXL refused the WRITE", True
                    return False
        except Exception as e:
            f.failing = f"posting layers {layers[0]}-{layers[1]} of tokens {tokens[0]}-{tokens[1]} failed: {e}"
            logger.warning("push %s: %s", fp.transfer_id, f.failing)
            return False
        f.record.bytes += nbytes
        f.record.descriptors += len(loc)
        return True

    def next(self, f: InFlight) -> None:
        """A layer-wise flow with no WRITE in flight: fail it, commit it, or post more (a
        restarted push from its first token, over what its older WRITEs landed)."""
        m, p = f.match, f.match.prefill.progress
        posted = f.record.writes > 0
        if not f.failing and not p.final and time.monotonic() >= m.registration.post_by:
            f.failing = "D's post_by deadline passed before the prefill finished"
        if f.failing or p.aborted:
            self.loop.in_flight.pop(m.prefill.key, None)
            why = f.failing or "P's request was aborted"
            if f.errored:
                self.loop.failed_write(f, why)
            else:
                self.loop.fail(m, why, f.record, posted=posted)
            return
        if f.gen != p.gen:
            f.gen, f.sent_tokens, f.sent, f.done_bytes, f.learned = p.gen, 0, 0, 0, False
            f.record.bytes = f.record.descriptors = f.record.layers = f.record.overlap_bytes = 0
        if p.final and f.sent >= p.layers and p.last_start is not None and f.sent_tokens >= p.last_start:
            self._commit(f)
            return
        self.post(f)

    def _commit(self, f: InFlight) -> None:
        """Every layer's WRITE has ended (each flushed: its bytes are in D's memory) and the
        request has finished: the completion notification tells D the flow is whole."""
        m = f.match
        fp, pr = m.prefill, m.registration
        self.loop.in_flight.pop(fp.key, None)
        final_times(fp.progress, f.record)
        peer = self.loop.lanes.peer(pr.reg.agent_name)
        short = "D's handshake is gone" if peer is None else self.loop.plans.too_few_blocks(peer.hello, fp.block_ids,
                                                                                           pr.reg)
        if short:  # (a prompt shorter than D's: the scheduler's blocks never reached D's count)
            self.loop.fail(m, short, f.record, posted=f.record.writes > 0)
            return
        try:
            if self.loop.kv_verify is None:
                notif = M.make_notif(fp.transfer_id)
            else:
                loop, peer = self.loop, self.loop.lanes.peers[pr.reg.agent_name]
                loc = loop.plans.whole(peer.hello, fp.block_ids, pr.reg)[0]
                notif = loop.kv_verify.p_notif(fp.transfer_id, loop.layout, loop.compat, peer.hello, fp.block_ids,
                                               pr.reg, loc)
            if f.record.writes == 0:  # this rank writes no head of D's: the notification alone
                self.loop.channel.ack(pr.reply_to, fp.transfer_id, "posted")
            f.agent.send_notif(pr.reg.agent_name, notif)
        except Exception as e:
            self.loop.fail(m, f"committing the push failed: {e}", f.record, posted=f.record.writes > 0)
            return
        rec = f.record
        rec.completed_at = time.time()
        for name, n in (("pushes_layered", 1), ("layers_pushed", rec.layers), ("layer_bytes", rec.bytes),
                        ("layer_overlap_bytes", rec.overlap_bytes)):
            self.loop.stats.inc(name, n)
        self.loop.succeed(m, rec)


def final_times(p: Any, rec: TransferRecord) -> None:
    """A layer-wise record's prefill times are the request's end, as a whole push's are."""
    if p.finished_at is not None:
        rec.prefill_done_at = p.finished_at
    if p.times is not None:
        for k, v in p.times.record_fields().items():
            setattr(rec, k, v)
