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

1. the push completed: its NIXL notification came from an agent of the P process
   the registration was sent to (the notification follows the bytes), or
2. that P process (the Ack's instance) answered that it never posted a WRITE for it
   and never will (a cancel before the post, a rejection, ``post_by`` passed), and D
   had not heard that a WRITE was posted, or
3. P reported a posted WRITE ended (failed: its connection broke, nothing more
   comes), plus ``grace_s`` of progress, or
4. P went silent and every lane connection of that P process into D is closed and
   drained (P's process is gone: its kernel closed them after the last byte), plus
   ``grace_s`` of progress, or
5. P went silent, D knows none of its lane connections (so 4 cannot be checked),
   and ``write_bound_s + grace_s`` passed after the registration's ``post_by``
   (sent + ``max_wait_s``: P posts nothing later).

Giving up (P silent for ``liveness_s``, ``max_wait_s`` passed, D's own request
ended) only sends a Cancel, re-sent with back-off until P answers (for at most
``liveness_s``): P drops the registration if it has not posted yet.

A request's push may be several flows, one per P rank that writes into this D
rank (P's TP size above D's): one transfer id, one registration per P peer, each
flow fenced on its own (keyed by transfer id and peer). The request is released
when its last flow is; it failed when any flow failed, and a failed flow gives up
its siblings at once (their Cancels go out, their fences hold their blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection

# Cancel re-sends (a Cancel or its answer may be lost): the first re-send this long
# after the Cancel, each next one twice as late up to the cap; none later than
# liveness_s after the first Cancel (P silent that long: the fence decides).
CANCEL_RETRY_FIRST_S = 0.25
CANCEL_RETRY_MAX_S = 4.0
# While the control connection proves P's process alive, a silent P's liveness clock is
# moved this far ahead at a time, and judged again then (so a connection that drops
# ends the hold within this).
TRANSPORT_HOLD_S = 1.0


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
    cancels: int = 0  # Cancels sent so far
    cancel_first_at: float = 0.0
    cancel_next_at: float = 0.0  # when the Cancel is due again
    answered: bool = False  # P gave a final answer (maybe ignored): stop re-sending Cancel
    sent_at: float = 0.0  # on D's clock: P posts nothing after sent_at + max_wait_s
    cancelled: bool = False  # D's own request ended: release, never report a failure
    failed: bool = False  # will be reported failed when released
    drained_since: float | None = None  # case 3/4 above: released grace_s after this
    posted: bool = False  # P said a WRITE is (was) posted: bytes are (or were) moving
    spin_until: float = 0.0  # D progresses without pause until then
    held_by_transport: bool = False  # its liveness clock was held by a live control connection
    epoch: int | None = None  # the control connection P last spoke about it on (sent: sent on)
    why: str = ""
    released_by: str = ""  # expire's release: "drain" (path 4) or "bound" (path 5)
    peer_rank: int = -1  # the P rank at ``peer`` (for the trace), -1: not given
    serial: int = 0  # the registration that made it (add's answer): a stale command names another


class ReceiverState:
    def __init__(
        self, liveness_s: float, max_wait_s: float, grace_s: float, clock: Callable[[], float] = time.monotonic,
        write_bound_s: float = 30.0,
    ):
        self.liveness_s = liveness_s
        self.max_wait_s = max_wait_s
        self.grace_s = grace_s
        self.clock = clock
        # Path 5: how long a WRITE posted at the last moment may still be landing
        # (the connector's transfer_timeout_s: a push running longer is "slow").
        self.write_bound_s = write_bound_s
        # transfer id -> P peer -> its flow (one peer unless several P ranks write here)
        self.by_tid: dict[str, dict[str, Waiting]] = {}
        self._flows_left: dict[str, int] = {}  # request id -> its flows not ended yet
        self._failing: set[str] = set()  # request ids one of whose flows failed
        self.released: set[str] = set()  # request ids: blocks hold the KV or are safe to reuse
        self.failed: set[str] = set()  # subset of released: the KV did not arrive
        self.transport_holds = 0  # flows whose liveness clock a live control connection held
        self._serial = 0  # registrations made so far

    # -- inputs ------------------------------------------------------------------
    def add(self, request_id: str, transfer_id: str, peer: str | list[str], peer_ranks: list[int] | None = None
            ) -> int:
        """Wait for ``transfer_id`` from ``peer`` (several: one flow from each, added
        together so that none can end the request before the others are known).
        Returns this registration's serial (above 0), which its flows carry; 0 for a
        transfer id already waiting, or a request already waiting: the caller rejects
        the new request."""
        peers = [peer] if isinstance(peer, str) else list(dict.fromkeys(peer))
        if transfer_id in self.by_tid or request_id in self._flows_left or not peers:
            return 0
        now = self.clock()
        self._serial += 1
        ranks = peer_ranks if peer_ranks is not None and len(peer_ranks) == len(peers) else [-1] * len(peers)
        self.by_tid[transfer_id] = {
            p: Waiting(request_id, transfer_id, p, now + self.liveness_s, now + self.max_wait_s, peer_rank=r,
                       serial=self._serial)
            for p, r in zip(peers, ranks)}
        self._flows_left[request_id] = len(peers)
        return self._serial

    def rename_peer(self, transfer_id: str, peer: str, to: str, serial: int) -> bool:
        """Registration ``serial``'s flow of ``transfer_id`` from ``peer`` waits on ``to``
        from now on (the address the request's spelling resolved to). False when the
        transfer already has a flow from ``to`` (one request named one P twice); True when
        there is nothing to rename (another registration's flow is not touched)."""
        flows = self.by_tid.get(transfer_id)
        w = flows.get(peer) if flows else None
        if w is None or peer == to or w.serial != serial:
            return True
        if to in flows:
            return False
        del flows[peer]
        w.peer = to
        flows[to] = w
        return True

    def get(self, transfer_id: str, peer: str | None = None) -> Waiting | None:
        """The flow of ``transfer_id`` from ``peer``; without a peer, the transfer's only flow."""
        flows = self.by_tid.get(transfer_id)
        if not flows:
            return None
        if peer is not None:
            return flows.get(peer)
        return next(iter(flows.values())) if len(flows) == 1 else None

    def waiting(self) -> list[Waiting]:
        """Every flow still waiting."""
        return [w for flows in self.by_tid.values() for w in flows.values()]

    def reject_new(self, request_id: str) -> None:
        """A request that was never registered with P (duplicate id): fail and free it.
        Not one whose flows are waiting (a second registration of a live request): their
        fences decide when its blocks are free."""
        if request_id in self._flows_left:
            return
        self.failed.add(request_id)
        self.released.add(request_id)

    def failing(self, request_id: str) -> bool:
        """One of the request's flows failed: it is (or will be) released as failed."""
        return request_id in self._failing or request_id in self.failed

    def on_sent(self, transfer_id: str, instance: str = "", peer: str | None = None,
                request_id: str | None = None, epoch: int | None = None) -> bool:
        """The Register is about to leave for P process ``instance``. Called under the
        same lock as the check that it still waits, before the send: an abort from
        then on fences it instead of releasing it as never sent. False: not waiting
        (given up while queued), already sent, or the flow is another request's (a
        Register left queued by an ended request whose transfer id was reused: its
        blocks are not this request's): do not send it."""
        w = self.get(transfer_id, peer)
        if w is None or w.sent or (request_id is not None and w.request_id != request_id):
            return False
        now = self.clock()  # the clocks start when P can know of it
        w.sent, w.instance, w.sent_at, w.epoch = True, instance, now, epoch
        w.live_deadline = now + self.liveness_s
        w.give_up_at = now + self.max_wait_s
        return True

    def send_failed(self, transfer_id: str, why: str, peer: str | None = None,
                    request_id: str | None = None) -> Waiting | None:
        """The Register marked sent was not queued after all (the NOBLOCK send failed):
        P cannot know of it, so nothing is posted. Ends it (only ``request_id``'s flow)."""
        w = self.get(transfer_id, peer)
        if w is not None and (request_id is None or w.request_id == request_id):
            self._end(w, why)
            return w
        return None

    def current(self, transfer_id: str, peer: str, serial: int) -> bool:
        """Registration ``serial``'s flow of ``transfer_id`` from ``peer`` still waits
        (not ended, nor replaced by a later registration of the same ids)."""
        w = self.by_tid.get(transfer_id, {}).get(peer)
        return w is not None and w.serial == serial

    def waits(self, request_id: str) -> bool:
        """Flows of ``request_id`` are waiting."""
        return request_id in self._flows_left

    def on_unknown_peer(self, transfer_id: str, peer: str | None = None) -> Waiting | None:
        """P answered that it has no handshake with us (it restarted): it dropped the
        registration without posting anything. It is re-sent after a new handshake."""
        w = self.get(transfer_id, peer)
        if w is not None:
            w.sent = False
            if w.gave_up:
                self._end(w, "given up before P knew of it")
        return w

    def on_alive(self, transfer_id: str, peer: str | None = None, epoch: int | None = None) -> None:
        """P accepted the registration or heartbeated it (it holds it, maybe writing).
        ``epoch``: the control connection it said so on (what the liveness hold trusts)."""
        w = self.get(transfer_id, peer)
        if w is not None:
            w.epoch = epoch
            w.live_deadline = self.clock() + self.liveness_s
            w.drained_since = None

    def on_posted(self, transfer_id: str, nbytes: int, rate_bps: float = 1e9, margin_s: float = 0.005,
                  peer: str | None = None, epoch: int | None = None) -> None:
        """P is posting the WRITE now: D should progress continuously for about as long
        as the bytes take at ``rate_bps`` (after that, its regular fast polls)."""
        w = self.get(transfer_id, peer)
        if w is not None:
            now = self.clock()
            w.posted, w.epoch = True, epoch
            w.live_deadline = now + self.liveness_s
            w.spin_until = now + margin_s + nbytes / rate_bps

    def progress_need(self) -> str:
        """How fast D must progress UCX: "spin" (a posted push should be moving now),
        "fast" (a posted push is slow, or a handshake's probes may be), or "idle"."""
        now = self.clock()
        need = "idle"
        for w in self.waiting():
            if w.spin_until > now:
                return "spin"
            if w.posted or not w.sent:
                need = "fast"
        return need

    def on_done(self, transfer_id: str, agent: str, agents: Callable[[str, str], Collection[str]],
                bad: str = "") -> Waiting | None:
        """The push completed: the KV is there, even if D had given up meanwhile.
        Accepted only for a sent registration and from ``agent`` among
        ``agents(peer, instance)``, the NIXL agents of the P process it was sent to;
        anything else is stray (None), and the caller counts it.
        ``bad``: the push completed (no more bytes come) but what landed is wrong
        (kv_verify's mismatch): the flow fails, released at once as a completed one."""
        w = self.done_flow(transfer_id, agent, agents)
        if w is None:
            return None
        if bad:
            self._end(w, bad)
        else:
            self._flow_ended(w, ok=True)
        return w

    def done_flow(self, transfer_id: str, agent: str, agents: Callable[[str, str], Collection[str]]
                  ) -> Waiting | None:
        """The flow that a completion notification of ``transfer_id`` from ``agent``
        ends (see ``on_done``), without ending it; None: stray."""
        return next((f for f in self.by_tid.get(transfer_id, {}).values()
                     if f.sent and agent in agents(f.peer, f.instance)), None)

    def on_ended(self, transfer_id: str, posted: bool, why: str = "", *, instance: str,
                 peer: str | None = None) -> tuple[str, Waiting | None]:
        """P's final answer without success, from P process ``instance``. Returns
        (outcome, waiting): "unknown" (not waiting), "ignored" (held, see below),
        "fenced" (``posted``: a WRITE was posted and ended, so its connection is done;
        D keeps progressing ``grace_s``, then reuses the blocks) or "released".

        Ignored, because it proves nothing about what may still land: an answer from
        another P process than the one the registration went to (a restarted P
        answering a Cancel for a transfer it never saw; an empty instance is unknown),
        and a "never posted" answer after D learned a WRITE was posted or once a fence
        started (the fence of that WRITE stays)."""
        w = self.get(transfer_id, peer)
        if w is None:
            return "unknown", None
        w.answered = True  # a final answer: stop re-sending Cancel
        if not instance or instance != w.instance:
            return "ignored", w
        if not posted and (w.posted or w.drained_since is not None):
            return "ignored", w
        w.why = why
        if posted:
            now = self.clock()
            w.gave_up = w.posted = True  # nothing more to hear from P about it
            w.drained_since = w.drained_since if w.drained_since is not None else now
            w.live_deadline = now
            return "fenced", w
        self._end(w, why)
        return "released", w

    def cancel_request(self, request_id: str) -> list[Waiting]:
        """D's own request ended while waiting (vLLM holds its blocks for us): every
        flow of it is given up."""
        out = [w for w in self.waiting() if w.request_id == request_id]
        for w in out:
            w.cancelled = True
            w.gave_up = True
            if not w.sent:
                self._end(w, "cancelled")
        return out

    def peer_restarted(self, peer: str) -> list[Waiting]:
        """P at ``peer`` is a new process: what the old one held will never be pushed,
        and its connections are closed; release once they are drained."""
        now = self.clock()
        out = [w for w in self.waiting() if w.peer == peer and w.sent]
        for w in out:
            w.gave_up, w.why, w.live_deadline = True, "P restarted", now
        return out

    def fail_unsent(self, peer: str, why: str) -> list[Waiting]:
        """Registrations to ``peer`` that never left D (handshake refused)."""
        out = [w for w in self.waiting() if w.peer == peer and not w.sent]
        for w in out:
            self._end(w, why)
        return out

    def expire(self, drained: Callable[[str, str], bool | None],
               transport_alive: Callable[[str], int | None] = lambda peer: None
               ) -> tuple[list[Waiting], list[Waiting]]:
        """Advance the clocks. ``drained(peer, instance)``: are all lane connections of
        that P process into D closed with nothing left unread? None: D knows none of
        them (cannot tell). ``transport_alive(peer)``: the control connection to P that
        is up now (its epoch; None: none is), its ZMTP heartbeats answered, so P's process
        lives. A registration's liveness clock is held while that is the connection it
        was sent on and P last spoke about it on (a message lost with an earlier one is
        not waited for), or while it waits for P's Welcome: P's Python threads may just
        be waiting for a busy core. ``max_wait_s`` still bounds the wait.
        Returns (newly given up, released by a drain or the bound, see
        ``Waiting.released_by``)."""
        now = self.clock()
        gave_up, released = [], []
        for w in list(self.waiting()):
            # sent or not: an unsent one waits for P's Welcome, which P sends once it has
            # opened its lanes to us (lane probes, slow on a saturated core)
            up = transport_alive(w.peer) if not w.gave_up and w.live_deadline <= now < w.give_up_at else None
            if up is not None and (not w.sent or w.epoch == up):
                if not w.held_by_transport:
                    w.held_by_transport = True
                    self.transport_holds += 1
                w.live_deadline = now + TRANSPORT_HOLD_S  # judged again then
            if not w.gave_up and (now >= w.live_deadline or now >= w.give_up_at):
                w.gave_up = True
                w.why = "max_wait_s passed" if now >= w.give_up_at else "P silent"
                gave_up.append(w)
                if not w.sent:
                    self._end(w, w.why)
                    continue
            if not w.gave_up or now < w.live_deadline:
                continue  # P is alive and holds it: its answer or the push will come
            if w.drained_since is None:
                d = drained(w.peer, w.instance)
                if d:
                    w.drained_since = now
                elif d is None and now >= w.sent_at + self.max_wait_s + self.write_bound_s + self.grace_s:
                    # Path 5: no lane known to watch; P posted nothing after sent +
                    # max_wait_s and gave a WRITE write_bound_s, plus the grace.
                    w.released_by = "bound"
                    self._end(w, w.why or "P silent")
                    released.append(w)
            elif now - w.drained_since >= self.grace_s:
                w.released_by = w.released_by or "drain"
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
        """Flows still waiting."""
        return sum(len(flows) for flows in self.by_tid.values())

    def fencing(self) -> list[Waiting]:
        """Given up, P silent: waiting for P's lane connections to drain (what
        ``expire`` asks ``drained`` about; newly given-up ones are asked next time)."""
        now = self.clock()
        return [w for w in self.waiting()
                if w.gave_up and w.sent and now >= w.live_deadline and w.drained_since is None]

    def to_cancel(self) -> list[Waiting]:
        """Given up and sent to P, no final answer from P yet, and a Cancel is due: the
        first at once, re-sent after CANCEL_RETRY_FIRST_S doubling up to
        CANCEL_RETRY_MAX_S (a Cancel or its answer may be lost: a reconnecting
        socket, a full queue), never later than ``liveness_s`` after the first. The
        caller sends a Cancel for each one returned (they are counted as sent)."""
        now = self.clock()
        out = []
        for w in self.waiting():
            if not (w.gave_up and w.sent) or w.answered or now < w.cancel_next_at:
                continue
            if w.cancels == 0:
                w.cancel_first_at = now
            elif now >= w.cancel_first_at + self.liveness_s:
                continue  # P silent all along: the drain fence or the bound decides
            w.cancel_next_at = now + min(CANCEL_RETRY_FIRST_S * 2 ** w.cancels, CANCEL_RETRY_MAX_S)
            w.cancels += 1
            out.append(w)
        return out

    def _end(self, w: Waiting, why: str) -> None:
        """The flow ended without its KV (failed, or cancelled by D)."""
        w.why = w.why or why
        self._flow_ended(w, ok=False)

    def _flow_ended(self, w: Waiting, ok: bool) -> None:
        flows = self.by_tid.get(w.transfer_id)
        if flows is None or flows.get(w.peer) is not w:
            return  # ended before
        del flows[w.peer]
        if not flows:
            del self.by_tid[w.transfer_id]
        rid = w.request_id
        if not ok and not w.cancelled and rid not in self._failing:
            self._failing.add(rid)
            for sib in list(flows.values()):  # the request fails: its other flows are not waited for
                if not sib.gave_up:
                    sib.gave_up, sib.why = True, f"another flow of the request failed ({w.why})"
                    sib.live_deadline = min(sib.live_deadline, self.clock() + self.liveness_s)
                    if not sib.sent:
                        self._end(sib, sib.why)
        left = self._flows_left.get(rid, 1) - 1
        if left > 0:
            self._flows_left[rid] = left
            return
        self._flows_left.pop(rid, None)
        self.released.add(rid)
        if rid in self._failing:
            self._failing.discard(rid)
            self.failed.add(rid)
