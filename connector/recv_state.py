"""D-side bookkeeping of registered requests waiting for their push (pure logic).

Two outcomes leave this module:

- ``released``: no WRITE can land in the request's blocks any more, so vLLM may
  free or reuse them (vLLM's ``finished_recving``). Reported exactly once per
  registered request.
- ``failed``: the request's KV did not arrive; vLLM ends it with an error or
  recomputes it (``failed_recving``). vLLM frees or reuses the blocks of a failed
  request at once, so a failure is only reported together with its release.

The fence. Neither NIXL nor UCX can stop a posted WRITE over TCP: bytes queued in
P's socket, the network and D's socket still land after any cancel. So D never
frees a registration's blocks on a timer. It releases them when

1. the push completed (the NIXL notification follows the bytes), or
2. P answered that it never posted a WRITE for it and never will (a cancel before
   the post, a rejection, ``post_by`` passed), or
3. P reported the posted WRITE failed (its connection broke: nothing more comes),
   plus ``grace_s`` of progress, or
4. P went silent and every lane connection of P's into D is closed and drained
   (P's process is gone: its kernel closed them after the last byte), plus
   ``grace_s`` of progress.

Giving up (P silent for ``liveness_s``, ``max_wait_s`` passed, D's own request
ended) only sends a Cancel: P drops the registration if it has not posted yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Waiting:
    request_id: str
    transfer_id: str
    peer: str
    live_deadline: float  # P has been silent about it until then: give up
    give_up_at: float  # max_wait: give up even if P is alive
    sent: bool = False  # the Register left D (else P cannot know it: release at once)
    instance: str = ""  # the P process it was sent to
    gave_up: bool = False  # D asked P to drop it (Cancel)
    cancel_sent: bool = False
    cancelled: bool = False  # D's own request ended: release, never report a failure
    failed: bool = False  # will be reported failed when released
    drained_since: float | None = None  # case 3/4 above: released grace_s after this
    posted: bool = False  # P said it is posting the WRITE: bytes are (or will be) moving
    spin_until: float = 0.0  # D progresses without pause until then
    why: str = ""


class ReceiverState:
    def __init__(
        self, liveness_s: float, max_wait_s: float, grace_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.liveness_s = liveness_s
        self.max_wait_s = max_wait_s
        self.grace_s = grace_s
        self.clock = clock
        self.by_tid: dict[str, Waiting] = {}
        self.released: set[str] = set()  # request ids: blocks hold the KV or are safe to reuse
        self.failed: set[str] = set()  # subset of released: the KV did not arrive
        self.early_done: set[str] = set()  # notification before our own registration (rare)

    # -- inputs ------------------------------------------------------------------
    def add(self, request_id: str, transfer_id: str, peer: str) -> bool:
        """False for a transfer id already waiting: the caller rejects the new request."""
        if transfer_id in self.by_tid:
            return False
        if transfer_id in self.early_done:
            self.early_done.discard(transfer_id)
            self.released.add(request_id)
            return True
        now = self.clock()
        self.by_tid[transfer_id] = Waiting(request_id, transfer_id, peer, now + self.liveness_s, now + self.max_wait_s)
        return True

    def reject_new(self, request_id: str) -> None:
        """A request that was never registered with P (duplicate id): fail and free it."""
        self.failed.add(request_id)
        self.released.add(request_id)

    def on_sent(self, transfer_id: str, instance: str = "") -> None:
        w = self.by_tid.get(transfer_id)
        if w is not None and not w.sent:
            now = self.clock()  # the clocks start when P can know of it
            w.sent, w.instance = True, instance
            w.live_deadline = now + self.liveness_s
            w.give_up_at = now + self.max_wait_s

    def on_unknown_peer(self, transfer_id: str) -> Waiting | None:
        """P answered that it has no handshake with us (it restarted): it dropped the
        registration without posting anything. It is re-sent after a new handshake."""
        w = self.by_tid.get(transfer_id)
        if w is not None:
            w.sent = False
            if w.gave_up:
                self._end(w, "given up before P knew of it")
        return w

    def on_alive(self, transfer_id: str) -> None:
        """P accepted the registration or heartbeated it (it holds it, maybe writing)."""
        w = self.by_tid.get(transfer_id)
        if w is not None:
            w.live_deadline = self.clock() + self.liveness_s
            w.drained_since = None

    def on_posted(self, transfer_id: str, nbytes: int, rate_bps: float = 1e9, margin_s: float = 0.005) -> None:
        """P is posting the WRITE now: D should progress continuously for about as long
        as the bytes take at ``rate_bps`` (after that, its regular fast polls)."""
        w = self.by_tid.get(transfer_id)
        if w is not None:
            now = self.clock()
            w.posted = True
            w.live_deadline = now + self.liveness_s
            w.spin_until = now + margin_s + nbytes / rate_bps

    def progress_need(self) -> str:
        """How fast D must progress UCX: "spin" (a posted push should be moving now),
        "fast" (a posted push is slow, or a handshake's probes may be), or "idle"."""
        now = self.clock()
        need = "idle"
        for w in self.by_tid.values():
            if w.spin_until > now:
                return "spin"
            if w.posted or not w.sent:
                need = "fast"
        return need

    def on_done(self, transfer_id: str) -> Waiting | None:
        """The push completed: the KV is there, even if D had given up meanwhile."""
        w = self.by_tid.pop(transfer_id, None)
        if w is None:
            if len(self.early_done) > 65536:  # stray notifications must not grow without bound
                self.early_done.clear()
            self.early_done.add(transfer_id)
            return None
        self.released.add(w.request_id)
        return w

    def on_ended(self, transfer_id: str, posted: bool, why: str = "") -> Waiting | None:
        """P's final answer without success. ``posted``: its WRITE failed on a broken
        connection; D keeps progressing ``grace_s`` before it reuses the blocks."""
        w = self.by_tid.get(transfer_id)
        if w is None:
            return None
        w.why = why
        if posted:
            now = self.clock()
            w.gave_up = w.cancel_sent = True  # nothing more to hear from P about it
            w.drained_since = w.drained_since or now
            w.live_deadline = now
        else:
            self._end(w, why)
        return w

    def cancel_request(self, request_id: str) -> Waiting | None:
        """D's own request ended while waiting (vLLM holds its blocks for us)."""
        for w in self.by_tid.values():
            if w.request_id == request_id:
                w.cancelled = True
                w.gave_up = True
                if not w.sent:
                    self._end(w, "cancelled")
                return w
        return None

    def peer_restarted(self, peer: str) -> list[Waiting]:
        """P at ``peer`` is a new process: what the old one held will never be pushed,
        and its connections are closed; release once they are drained."""
        now = self.clock()
        out = [w for w in self.by_tid.values() if w.peer == peer and w.sent]
        for w in out:
            w.gave_up, w.why, w.live_deadline = True, "P restarted", now
        return out

    def fail_unsent(self, peer: str, why: str) -> list[Waiting]:
        """Registrations to ``peer`` that never left D (handshake refused)."""
        out = [w for w in self.by_tid.values() if w.peer == peer and not w.sent]
        for w in out:
            self._end(w, why)
        return out

    def expire(self, drained: Callable[[str, str], bool]) -> tuple[list[Waiting], list[Waiting]]:
        """Advance the clocks. ``drained(peer, instance)``: are all lane connections of
        that P process into D closed with nothing left unread? Returns (newly given
        up, released by a drain)."""
        now = self.clock()
        gave_up, released = [], []
        for w in list(self.by_tid.values()):
            if not w.gave_up and (now >= w.live_deadline or now >= w.give_up_at):
                w.gave_up = True
                w.why = "P silent" if now >= w.live_deadline else "max_wait_s passed"
                gave_up.append(w)
                if not w.sent:
                    self._end(w, w.why)
                    continue
            if not w.gave_up or now < w.live_deadline:
                continue  # P is alive and holds it: its answer or the push will come
            if w.drained_since is None:
                if drained(w.peer, w.instance):
                    w.drained_since = now
            elif now - w.drained_since >= self.grace_s:
                self._end(w, w.why or "P silent")
                released.append(w)
        return gave_up, released

    # -- outputs ---------------------------------------------------------------
    def take(self) -> tuple[set[str], set[str]]:
        """(released, failed) since the last call; failed is a subset of released."""
        r, f = self.released, self.failed
        self.released, self.failed = set(), set()
        return r, f

    def pending(self) -> int:
        return len(self.by_tid)

    def fencing(self) -> list[Waiting]:
        """Given up, P silent: waiting for P's lane connections to drain (what
        ``expire`` asks ``drained`` about; newly given-up ones are asked next time)."""
        now = self.clock()
        return [w for w in self.by_tid.values()
                if w.gave_up and w.sent and now >= w.live_deadline and w.drained_since is None]

    def to_cancel(self) -> list[Waiting]:
        """Given up, sent to P, P not yet told."""
        return [w for w in self.by_tid.values() if w.gave_up and w.sent and not w.cancel_sent]

    def _end(self, w: Waiting, why: str) -> None:
        self.by_tid.pop(w.transfer_id, None)
        w.why = w.why or why
        self.released.add(w.request_id)
        if not w.cancelled:
            self.failed.add(w.request_id)
