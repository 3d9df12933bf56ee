"""Pushes that wait for a lane: a D whose every lane is broken gets one reopened on the
writer's loop (:mod:`kvpath.connector.lane_setup`), and its pushes wait here meanwhile
instead of the writer reopening the lane in place (a probe can take seconds).

A waiting push is still matched (``state.active``): it ends exactly once, by going on
when a lane to its D is open again, or by failing (the reopen failed with no lane left,
D's ``post_by`` passed, P shuts down), or by D's Cancel (nothing was posted). Its
blocks are freed in every case but the first, where the WRITE takes them over.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvpath.connector.lane_setup import MAX_QUEUED_SETUPS
from kvpath.connector.push_state import Match
from kvpath.trace import TransferRecord

if TYPE_CHECKING:
    from kvpath.connector.lane_setup import Peer
    from kvpath.connector.sender import PushSender

logger = logging.getLogger(__name__)


class ParkedPushes:
    """A mixin of :class:`~kvpath.connector.sender.PushSender` (its state: ``_parked``,
    D agent name -> the pushes waiting for a lane to it, oldest first)."""

    def _park(self: "PushSender", peer: "Peer", lane: int, m: Match, rec: TransferRecord) -> None:
        """A push to a D with no lane open: queue lane ``lane``'s reopen and wait for it."""
        name = peer.hello.agent_name
        if not self._queue_lane_reopen(peer, lane) and name not in self._parked:
            self._fail(m, f"no lane to D is open and {MAX_QUEUED_SETUPS} lane set-ups are queued", rec)
            return
        self._parked.setdefault(name, []).append((m, rec))

    def _reopen_ended(self: "PushSender", name: str, why: str | None) -> None:
        """A lane reopen to D ``name`` ended (``why``: it failed). Its waiting pushes go on
        when a lane to D is open now; when none is, they fail, and the D's other queued
        reopens are dropped (D is unreachable: each would spend its own probe timeout)."""
        if name not in self._parked:
            return
        peer = self._peers.get(name)
        if peer is not None and any(not ln.broken for ln in peer.lanes.lanes):
            self._unpark(name, None)
            return
        for key in [k for k in self._reopens if k[0] == name]:
            del self._reopens[key]
        self._unpark(name, why or "no lane to D could be reopened")

    def _unpark(self: "PushSender", name: str, why: str | None) -> None:
        """Start D ``name``'s waiting pushes (``why`` None), or fail them with ``why``.
        Each on its own: one that raises is failed and strands none of the others."""
        for m, rec in self._parked.pop(name, []):
            try:
                if why is None:
                    self._start_write(m)
                else:
                    self._fail(m, why, rec)
            except Exception as e:
                logger.exception("push %s waiting for a lane could not go on", m.prefill.transfer_id)
                try:
                    self._fail(m, f"resuming the push failed: {e}", rec)
                except Exception:
                    logger.exception("failing push %s failed", m.prefill.transfer_id)

    def _expire_parked(self: "PushSender", now: float) -> None:
        """Fail the waiting pushes whose D deadline (``post_by``) passed: their WRITE may
        no longer be posted, so they cannot wait for the lane any longer."""
        for name in list(self._parked):
            waiting = self._parked[name]
            late = [(m, rec) for m, rec in waiting if now >= m.registration.post_by]
            if not late:
                continue
            self._parked[name] = [x for x in waiting if x not in late]
            if not self._parked[name]:
                del self._parked[name]
            for m, rec in late:
                try:
                    self._fail(m, "D's post_by deadline passed while its lane reopened", rec)
                except Exception:
                    logger.exception("failing push %s failed", m.prefill.transfer_id)

    def _take_parked(self: "PushSender", key: str) -> tuple[Match, TransferRecord] | None:
        """Remove a waiting push (D cancelled it: nothing was posted)."""
        for name, waiting in self._parked.items():
            for i, (m, rec) in enumerate(waiting):
                if m.prefill.key == key:
                    del waiting[i]
                    if not waiting:
                        del self._parked[name]
                    return m, rec
        return None

    def _cancel_parked(self: "PushSender", key: str) -> bool:
        """D's Cancel of a push (flow ``key``) waiting for a lane: it ends "cancelled", not
        posted, its blocks freed. False when it is not waiting."""
        got = self._take_parked(key)
        if got is None:
            return False
        m, rec = got
        tid = m.prefill.transfer_id
        self.state.complete(key, "cancelled", posted=False)
        self._release(m.prefill)
        self.stats.inc("pushes_cancelled")
        rec.status, rec.detail, rec.completed_at = "cancelled", "cancelled while its lane reopened", time.time()
        self._record(rec)
        self._ack(m.registration.reply_to, tid, "cancelled", "cancelled while its lane reopened", False)
        return True
