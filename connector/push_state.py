"""P-side matching of finished prefills with D registrations (no I/O, no threads).

Either side can come first. A match is returned exactly once per transfer id;
duplicates are reported, never re-executed. Deadlines bound how long anything
waits: a finished prefill whose registration never comes is expired after the
lease (its blocks are freed), and a registration whose prefill has not finished
by D's ``post_by`` is expired (D is told no WRITE was posted).
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvpath.connector.messages import Register


@dataclass
class FinishedPrefill:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    lane: int | None = None  # lane chosen by the caller (the proxy); None: hash
    lease_id: str | None = None  # the reservation behind that lane, released when the push ends
    lane_asked: bool = False  # reserve_at=push: P has asked the reservation service for its lane
    transfer_key: str = ""  # when set, only a registration carrying it gets the push
    finished_at: float = field(default_factory=time.time)
    deadline: float = 0.0


@dataclass
class PendingRegistration:
    reg: Register
    reply_to: bytes  # control-channel identity of the D worker
    received_at: float = field(default_factory=time.time)
    # On the writer's clock: no WRITE is posted after this (D's max_wait_s).
    post_by: float = 0.0


@dataclass
class Match:
    prefill: FinishedPrefill
    registration: PendingRegistration


@dataclass
class Expired:
    prefills: list[FinishedPrefill] = field(default_factory=list)
    registrations: list[PendingRegistration] = field(default_factory=list)


def _keys_fit(fp: FinishedPrefill, reg: Register) -> bool:
    """No transfer key on P's request: any registration; else exactly that key."""
    if not fp.transfer_key:
        return True
    return hmac.compare_digest(fp.transfer_key.encode(), reg.transfer_key.encode())


class WriterState:
    """Bookkeeping of the writer thread, kept pure so it can be unit-tested."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, remember: int = 65536):
        self.lease_s = lease_s
        self.clock = clock
        self.prefills: dict[str, FinishedPrefill] = {}  # waiting for a registration
        self.registrations: dict[str, PendingRegistration] = {}  # waiting for a prefill
        self.active: dict[str, Match] = {}  # matched, being written
        self.aborted: set[str] = set()  # P request aborted before matching
        # transfer id -> (final status, a WRITE was posted for it): a Cancel arriving
        # after the end is answered with this, never with "cancelled, not posted".
        self._done: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        self._remember = remember
        self.forgotten = 0  # records dropped to stay bounded

    # -- inputs -----------------------------------------------------------
    def add_registration(self, reg: Register, reply_to: bytes, post_by: float) -> tuple[str, Match | None]:
        """Returns ("matched", m) | ("waiting", None) | ("duplicate", None) | ("aborted", None)
        | ("key_mismatch", None): the prefill waits with a transfer key this registration
        does not carry, so it is refused and the prefill keeps waiting for the right one."""
        tid = reg.transfer_id
        if tid in self.registrations or tid in self.active or tid in self._done:
            return "duplicate", None
        if tid in self.aborted:
            self.aborted.discard(tid)
            self._finish(tid, "aborted", posted=False)
            return "aborted", None
        pr = PendingRegistration(reg, reply_to, post_by=post_by)
        fp = self.prefills.get(tid)
        if fp is None:
            self.registrations[tid] = pr
            return "waiting", None
        if not _keys_fit(fp, reg):
            return "key_mismatch", None
        del self.prefills[tid]
        m = Match(fp, pr)
        self.active[tid] = m
        return "matched", m

    def add_prefill(self, fp: FinishedPrefill) -> tuple[str, Match | None]:
        """Returns ("matched", m) | ("waiting", None) | ("duplicate", None) | ("dead", None)
        | ("key_mismatch", m).

        "dead": the transfer already ended (cancelled by D, expired, aborted):
        the caller frees this prefill's blocks at once. "key_mismatch": the waiting
        registration (``m.registration``, dropped: the caller refuses it) lacks the
        prefill's transfer key; the prefill waits for another registration or its lease.
        """
        tid = fp.transfer_id
        if tid in self.prefills or tid in self.active:
            return "duplicate", None
        if tid in self._done:
            return "dead", None
        fp.deadline = self.clock() + self.lease_s
        pr = self.registrations.pop(tid, None)
        if pr is None:
            self.prefills[tid] = fp
            return "waiting", None
        if not _keys_fit(fp, pr.reg):
            self.prefills[tid] = fp
            return "key_mismatch", Match(fp, pr)
        m = Match(fp, pr)
        self.active[tid] = m
        return "matched", m

    def cancel(self, transfer_id: str) -> tuple[str, FinishedPrefill | None, PendingRegistration | None]:
        """D gave up on a transfer. Returns (status, prefill to free, registration dropped):
        "in_flight" (too late: the WRITE finishes or fails; D hears that), "done" (it
        had ended: answer with :meth:`final`, which is kept as it was) or "cancelled"
        (nothing was posted and nothing will be; recorded, so a late Register for it is
        refused, also when this process never saw the transfer)."""
        if transfer_id in self.active:
            return "in_flight", None, None
        if transfer_id in self._done:
            return "done", None, None
        if transfer_id in self.prefills and transfer_id not in self.registrations:
            # nobody registered it (a Cancel's sender is bound to its own registrations):
            # the prefill keeps waiting for its registration or its lease
            return "unregistered", None, None
        pr = self.registrations.pop(transfer_id, None)
        fp = self.prefills.pop(transfer_id, None)
        # Unseen here. If records were ever forgotten (bounded memory), it may be one that
        # ended with a posted WRITE: say "posted", so D keeps its fence (grace) for it.
        self._finish(transfer_id, "cancelled", posted=pr is None and fp is None and self.forgotten > 0)
        return "cancelled", fp, pr

    def abort_prefill(self, transfer_id: str) -> PendingRegistration | None:
        """P's request ended without KV to push (aborted); reject D if it waits."""
        pr = self.registrations.pop(transfer_id, None)
        if pr is not None:
            self._finish(transfer_id, "aborted", posted=False)
        elif transfer_id not in self._done and transfer_id not in self.active:
            self.aborted.add(transfer_id)
        # An ended or in-flight transfer keeps its record: overwriting it with
        # "aborted, not posted" would let D skip the fence of a posted WRITE.
        return pr

    def complete(self, transfer_id: str, status: str = "ok", posted: bool = True) -> Match | None:
        """The matched push ended. ``posted``: a WRITE was posted (the default: when in
        doubt, D must fence)."""
        m = self.active.pop(transfer_id, None)
        if m is not None:
            self._finish(transfer_id, status, posted)
        return m

    def expire(self) -> Expired:
        now = self.clock()
        out = Expired()
        for tid in [t for t, fp in self.prefills.items() if fp.deadline <= now]:
            out.prefills.append(self.prefills.pop(tid))
            self._finish(tid, "expired", posted=False)
        for tid in [t for t, pr in self.registrations.items() if pr.post_by <= now]:
            out.registrations.append(self.registrations.pop(tid))
            self._finish(tid, "expired", posted=False)
        return out

    # -- queries ----------------------------------------------------------
    def holder(self, transfer_id: str) -> str | None:
        """P request id whose finished prefill holds ``transfer_id`` now, if any."""
        fp = self.prefills.get(transfer_id)
        if fp is None and transfer_id in self.active:
            fp = self.active[transfer_id].prefill
        return fp.request_id if fp is not None else None

    def registered_by(self, transfer_id: str) -> bytes | None:
        """The control identity of the D whose registration of ``transfer_id`` P holds."""
        pr = self.registrations.get(transfer_id)
        if pr is None and transfer_id in self.active:
            pr = self.active[transfer_id].registration
        return pr.reply_to if pr is not None else None

    def held_registrations(self) -> list[PendingRegistration]:
        """Registrations P holds (waiting for the prefill or being written): heartbeated."""
        return list(self.registrations.values()) + [m.registration for m in self.active.values()]

    def status_of(self, transfer_id: str) -> str | None:
        done = self._done.get(transfer_id)
        return done[0] if done is not None else None

    def final(self, transfer_id: str) -> tuple[str, bool] | None:
        """(final status, a WRITE was posted) of an ended transfer, None otherwise."""
        return self._done.get(transfer_id)

    def idle(self) -> bool:
        return not (self.prefills or self.registrations or self.active)

    def _finish(self, tid: str, status: str, posted: bool) -> None:
        self._done[tid] = (status, posted)
        self._done.move_to_end(tid)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
            self.forgotten += 1
        if len(self.aborted) > self._remember:
            self.aborted.clear()
