"""P-side matching of finished prefills with D registrations (no I/O, no threads).

Either side can come first. A match is returned exactly once per transfer id;
duplicates are reported, never re-executed. Deadlines bound how long anything
waits: a finished prefill whose registration never comes is expired after the
lease (its blocks are freed), and a registration whose prefill has not finished
by D's ``post_by`` is expired (D is told no WRITE was posted).

A finished prefill may be pushed by several flows, one per D rank that takes heads
from this P rank (D's TP size above P's: ``tp_map.d_ranks_of``). Each flow has its own
key (``flow_key``: the transfer id, plus the D rank when there are several), its own
registration, match, deadline and final record; the prefill's blocks are freed when
its last flow ends (``flow_ended``). P learns the fan-out from the first registration
(its Hello gives D's TP size): a prefill that comes first waits whole under its
transfer id and is split into its flows when a registration names them.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvpath.connector.layer_progress import LayerProgress
from kvpath.connector.step_commands import VllmTimes
from kvpath.connector.messages import Register


FLOW_SEP = "\x00"  # never in a transfer id (messages.validate_register refuses it)

# Registrations waiting for their prefill (what a D worker can make P hold without P
# doing anything). Per D worker also: no more block ids than D has blocks (an honest D
# registers each block for one request at a time).
MAX_WAITING_REGISTRATIONS = 16384  # in total, over every D worker
MAX_WAITING_PER_PEER = 2048  # per D worker (its control identity)


def flow_key(transfer_id: str, d_rank: int, fanout: int, d_tp: int = 0) -> str:
    """The key of one flow of a transfer at this P rank: the transfer id itself when the
    prefill has one flow (equal TP sizes, P's TP size above D's); else it names D's TP
    size and rank, so a D of another TP size never takes another shape's flow."""
    return transfer_id if fanout <= 1 else f"{transfer_id}{FLOW_SEP}{d_tp}.{d_rank}"


@dataclass
class Share:
    """The flows of one finished prefill still holding its blocks."""

    left: int
    keys: tuple[str, ...] = ()  # every flow of it
    ended: set[str] = field(default_factory=set)  # flows counted out: each once


@dataclass
class FinishedPrefill:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    lane: int | None = None  # lane chosen by the caller (the proxy); None: hash
    lease_id: str | None = None  # the reservation behind that lane, released when the push ends
    lane_asked: bool = False  # reserve_at=push: P has asked the reservation service for its lane
    reserved_bytes: int = 0  # the bytes it asked for (a layer-wise push's lease is told others later)
    transfer_key: str = ""  # when set, only a registration carrying it gets the push
    finished_at: float = field(default_factory=time.time)
    deadline: float = 0.0
    key: str = ""  # this flow's key ("": the transfer id, one flow)
    share: Share | None = None  # several flows: the blocks are freed when the last ends
    times: VllmTimes | None = None  # vLLM's own times of the P request (for the record)
    # push_granularity=layer: the prefill is still computing (its flows share this); None:
    # the request has finished, its KV goes in one WRITE
    progress: LayerProgress | None = None

    def __post_init__(self) -> None:
        self.key = self.key or self.transfer_id


@dataclass
class PendingRegistration:
    reg: Register
    reply_to: bytes  # control-channel identity of the D worker
    received_at: float = field(default_factory=time.time)
    # On the writer's clock: no WRITE is posted after this (D's max_wait_s).
    post_by: float = 0.0
    key: str = ""  # this flow's key ("": the transfer id)
    siblings: tuple[str, ...] = ()  # the keys of every flow of the transfer here (with key)

    def __post_init__(self) -> None:
        self.key = self.key or self.reg.transfer_id
        self.siblings = self.siblings or (self.key,)


class _Waiting(dict):
    """Registrations waiting for their prefill, with what each D worker (control
    identity) holds of them: counted as they come and go, so the bounds checked per
    Register cost nothing per registration held."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[bytes, list[int]] = {}  # reply_to -> [registrations, block ids]

    def _count(self, pr: "PendingRegistration", sign: int) -> None:
        h = self.held.setdefault(pr.reply_to, [0, 0])
        h[0] += sign
        h[1] += sign * len(pr.reg.block_ids)
        if h[0] <= 0:
            del self.held[pr.reply_to]

    def __setitem__(self, key: str, pr: "PendingRegistration") -> None:
        old = self.get(key)
        if old is not None:
            self._count(old, -1)
        super().__setitem__(key, pr)
        self._count(pr, +1)

    def __delitem__(self, key: str) -> None:
        self._count(self[key], -1)
        super().__delitem__(key)

    _MISSING = object()

    def pop(self, key: str, default=_MISSING):  # type: ignore[override]
        if key in self:
            pr = super().pop(key)
            self._count(pr, -1)
            return pr
        if default is self._MISSING:
            raise KeyError(key)
        return default


@dataclass
class Match:
    prefill: FinishedPrefill
    registration: PendingRegistration


@dataclass
class Expired:
    prefills: list[FinishedPrefill] = field(default_factory=list)
    registrations: list[PendingRegistration] = field(default_factory=list)


def _keys_fit(fp: FinishedPrefill, reg: Register) -> bool:
    """The transfer keys agree both ways: the same key on both sides, or none on either.
    A keyed registration never takes a keyless prefill (whoever sends P a leg naming a
    victim's transfer id without its key must not fill the victim's blocks), and a keyed
    prefill never goes to a registration without its key."""
    if not fp.transfer_key and not reg.transfer_key:
        return True
    return hmac.compare_digest(fp.transfer_key.encode(), reg.transfer_key.encode())


def _prefill_refused(fp: FinishedPrefill, reg: Register) -> bool:
    """On a mismatch, which side goes: a keyed prefill is the transfer's own (the
    registration is refused, the prefill waits on); a keyless prefill facing a keyed
    registration is the stranger (it is refused, its blocks freed, the registration
    waits on for the prefill that carries its key)."""
    return not fp.transfer_key and bool(reg.transfer_key)


class SenderState:
    """Bookkeeping of the writer thread, kept pure so it can be unit-tested. Every map
    is keyed by flow key, except ``prefills`` for a prefill not split yet (its transfer
    id) and ``_fan``/``_shares`` (transfer ids of fanned-out transfers)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, remember: int = 65536):
        self.lease_s = lease_s
        self.clock = clock
        self.prefills: dict[str, FinishedPrefill] = {}  # waiting for a registration
        self.registrations: _Waiting = _Waiting()  # waiting for a prefill
        self.active: dict[str, Match] = {}  # matched, being written
        self.aborted: set[str] = set()  # P request aborted before matching (transfer ids)
        # flow key -> (final status, a WRITE was posted for it): a Cancel arriving
        # after the end is answered with this, never with "cancelled, not posted".
        self._done: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        self._remember = remember
        self.forgotten = 0  # records dropped to stay bounded
        # transfer id -> its flows' keys, while fanned-out registrations wait for the prefill
        self._fan: dict[str, tuple[str, ...]] = {}
        # transfer id -> the split prefill (whole), while any of its flows holds its blocks
        self._shares: dict[str, tuple[FinishedPrefill, Share]] = {}
        # flow key -> the D that cancelled it unseen: its record refuses only that D's Register
        self._cancelled_by: dict[str, bytes] = {}
        # keyless prefills a keyed registration displaced: the caller frees their blocks
        self._refused: list[FinishedPrefill] = []

    # -- inputs -----------------------------------------------------------
    def add_registration(self, reg: Register, reply_to: bytes, post_by: float, key: str = "",
                         siblings: tuple[str, ...] = ()) -> tuple[str, Match | None]:
        """Returns ("matched", m) | ("waiting", None) | ("duplicate", None) | ("aborted", None)
        | ("key_mismatch", None): the prefill waits with a transfer key this registration
        does not carry, so it is refused and the prefill keeps waiting for the right one.
        ``key``/``siblings``: this flow's key and those of all the transfer's flows here
        (several when D's TP size is above P's)."""
        tid = reg.transfer_id
        pr = PendingRegistration(reg, reply_to, post_by=post_by, key=key, siblings=tuple(siblings))
        key, fanned = pr.key, len(pr.siblings) > 1
        if self._cancelled_by.get(key, reply_to) != reply_to:
            # another D cancelled this flow before anyone registered it: that says
            # nothing about this D's request (it never saw P), so the record goes
            del self._done[key], self._cancelled_by[key]
        if key in self.registrations or key in self.active or key in self._done or key not in pr.siblings:
            return "duplicate", None
        if fanned and (self._shape(tid, pr.siblings) != pr.siblings or tid in self.registrations
                       or tid in self.active or self._ended(tid, reply_to)):
            return "duplicate", None  # the id is taken by a transfer of another shape
        if not fanned and (tid in self._fan or tid in self._shares):
            return "duplicate", None
        if tid in self.aborted:
            if not fanned:
                self.aborted.discard(tid)
            self._finish(key, "aborted", posted=False)
            return "aborted", None
        template = self.prefills.get(tid) if fanned else None
        if template is not None and not _keys_fit(template, reg):
            if not _prefill_refused(template, reg):
                return "key_mismatch", None
            self._refused.append(self.prefills.pop(tid))
        elif template is not None:  # the prefill came first, whole: split it into its flows now
            del self.prefills[tid]
            self._split(template, pr.siblings)
        fp = self.prefills.get(key)
        if fp is not None and not _keys_fit(fp, reg):
            if not _prefill_refused(fp, reg):
                return "key_mismatch", None
            self._refused.append(self.prefills.pop(key))
            fp = None
        if fp is None:
            self.registrations[key] = pr
            if fanned:
                self._fan[tid] = pr.siblings
            return "waiting", None
        del self.prefills[key]
        m = Match(fp, pr)
        self.active[key] = m
        return "matched", m

    def add_prefill(self, fp: FinishedPrefill) -> tuple[str, list[Match]]:
        """Returns ("matched", [m, ...]) | ("waiting", []) | ("duplicate", []) | ("dead", [])
        | ("key_mismatch", [m, ...]) | ("refused", []).

        "dead": the transfer already ended (cancelled by D, expired, aborted):
        the caller frees this prefill's blocks at once. "key_mismatch": waiting
        registrations (``m.registration``, dropped: the caller refuses them) lack the
        prefill's transfer key; the prefill waits for others or its lease. With several
        flows waiting, "matched" lists every flow that can start. "refused": the prefill
        has no transfer key and a registration carrying one waits for this id: the caller
        frees the prefill's blocks; the registration waits on.
        """
        tid = fp.transfer_id
        if tid in self.prefills or tid in self.active or tid in self._shares or FLOW_SEP in tid:
            return "duplicate", []  # (params refuse a NUL in a transfer id: never a flow's key)
        if self._ended(tid):
            return "dead", []
        fp.deadline = self.clock() + self.lease_s
        siblings = self._fan.get(tid)
        waiting = [self.registrations[k] for k in siblings or (tid,) if k in self.registrations]
        if any(_prefill_refused(fp, w.reg) for w in waiting):
            return "refused", []  # a keyless prefill where a keyed registration waits
        if siblings is not None:
            del self._fan[tid]
            return self._split(fp, siblings)
        pr = self.registrations.pop(tid, None)
        if pr is None:
            self.prefills[tid] = fp
            return "waiting", []
        if not _keys_fit(fp, pr.reg):
            self.prefills[tid] = fp
            return "key_mismatch", [Match(fp, pr)]
        m = Match(fp, pr)
        self.active[tid] = m
        return "matched", [m]

    def _split(self, fp: FinishedPrefill, keys: tuple[str, ...]) -> tuple[str, list[Match]]:
        """Turn ``fp`` into one flow per key sharing its blocks; each matches its waiting
        registration, counts as ended if it already ended (a Cancel, an expiry), or waits."""
        share = Share(len(keys), keys)
        self._shares[fp.transfer_id] = (fp, share)
        matched, refused = [], []
        for k in keys:
            flow = dataclasses.replace(fp, key=k, share=share)
            pr = self.registrations.pop(k, None)
            if self._ended(k) or k in self.prefills or k in self.active:  # ended (or, never, taken)
                share.left -= 1
                share.ended.add(k)
            elif pr is None:
                self.prefills[k] = flow
            elif not _keys_fit(flow, pr.reg):
                self.prefills[k] = flow
                refused.append(Match(flow, pr))
            else:
                self.active[k] = m = Match(flow, pr)
                matched.append(m)
        if share.left == 0:  # every flow had ended: nothing holds the blocks
            del self._shares[fp.transfer_id]
            self._finish(fp.transfer_id, "ended", posted=False)
            return "dead", []
        if refused:
            return "key_mismatch", refused + matched
        return ("matched", matched) if matched else ("waiting", [])

    def flow_ended(self, fp: FinishedPrefill) -> bool:
        """One flow of ``fp`` ended (any way): True when its blocks are free now (its last
        flow, or a prefill of one flow). Called once per ended flow."""
        if fp.share is None:
            return True
        if fp.key in fp.share.ended:  # counted already: a second end of one flow frees nothing
            return False
        fp.share.ended.add(fp.key)
        fp.share.left -= 1
        if fp.share.left > 0:
            return False
        self._shares.pop(fp.transfer_id, None)
        # the transfer id is spent: a second prefill or registration with it is refused
        self._finish(fp.transfer_id, "ended", posted=False)
        return True

    def cancel(self, key: str, by: bytes | None = None) -> tuple[str, FinishedPrefill | None, PendingRegistration | None]:
        """D gave up on a flow. Returns (status, prefill to free, registration dropped):
        "in_flight" (too late: the WRITE finishes or fails; D hears that), "done" (it
        had ended: answer with :meth:`final`, which is kept as it was) or "cancelled"
        (nothing was posted and nothing will be; recorded, so a late Register for it is
        refused, also when this process never saw the transfer). The prefill returned
        is the flow's: free its blocks when ``flow_ended`` says so. ``by``: the sender's
        control identity; a record of a flow this process never saw refuses a later
        Register from that sender only (another D's Cancel cannot pre-empt the owner)."""
        if key in self.active:
            return "in_flight", None, None
        if key in self._done:
            return "done", None, None
        if key in self._fan or key in self._shares:
            # a transfer id whose flows are keyed per D rank: a Cancel that names no flow
            # (its sender registered none of them) touches nothing
            return "unregistered", None, None
        tid = key.split(FLOW_SEP, 1)[0]
        if key not in self.registrations and (key in self.prefills or tid in self.prefills):
            # nobody registered it (a Cancel's sender is bound to its own registrations),
            # also a flow of a prefill that waits whole under its transfer id: the
            # prefill keeps waiting for its registration or its lease
            return "unregistered", None, None
        pr = self.registrations.pop(key, None)
        fp = self.prefills.pop(key, None)
        # Unseen here. If records were ever forgotten (bounded memory), it may be one that
        # ended with a posted WRITE: say "posted", so D keeps its fence (grace) for it.
        unseen = pr is None and fp is None
        self._finish(key, "cancelled", posted=unseen and self.forgotten > 0)
        if unseen and by is not None:
            self._cancelled_by[key] = by
        if pr is not None:
            self._unfan(pr.reg.transfer_id, "cancelled")
        return "cancelled", fp, pr

    def renew_lease(self, transfer_id: str) -> None:
        """A layer-wise prefill's request finished: its flows still waiting for a
        registration get their lease from now, as a finished prefill does."""
        keys = self._shares[transfer_id][1].keys if transfer_id in self._shares else ()
        for k in (transfer_id, *keys):
            if k in self.prefills:
                self.prefills[k].deadline = self.clock() + self.lease_s

    def take_begun(self, transfer_id: str) -> list[FinishedPrefill]:
        """A layer-wise prefill whose request was aborted: its flows still waiting for a
        registration end now (the caller frees their blocks); matched flows end on the
        write loop once their WRITEs have."""
        keys = self._shares[transfer_id][1].keys if transfer_id in self._shares else ()
        out = []
        for k in (transfer_id, *keys):
            fp = self.prefills.pop(k, None)
            if fp is not None:
                out.append(fp)
                self._finish(k, "aborted", posted=False)
        return out

    def abort_prefill(self, transfer_id: str) -> list[PendingRegistration]:
        """P's request ended without KV to push (aborted); reject every D flow that waits."""
        keys = self._fan.pop(transfer_id, (transfer_id,))
        out = [pr for pr in (self.registrations.pop(k, None) for k in keys) if pr is not None]
        for pr in out:
            self._finish(pr.key, "aborted", posted=False)
        if len(keys) > 1 or not out:
            if transfer_id not in self._done and transfer_id not in self.active:
                # flows that register later are refused too
                self.aborted.add(transfer_id)
        # An ended or in-flight transfer keeps its record: overwriting it with
        # "aborted, not posted" would let D skip the fence of a posted WRITE.
        return out

    def complete(self, key: str, status: str = "ok", posted: bool = True) -> Match | None:
        """The matched push of flow ``key`` ended. ``posted``: a WRITE was posted (the
        default: when in doubt, D must fence)."""
        m = self.active.pop(key, None)
        if m is not None:
            self._finish(key, status, posted)
        return m

    def expire(self) -> Expired:
        now = self.clock()
        out = Expired()
        # (a prefill still computing waits for its registration until its request ends:
        # renew_lease gives it its lease then)
        for key in [k for k, fp in self.prefills.items() if fp.deadline <= now
                    and (fp.progress is None or fp.progress.final or fp.progress.aborted)]:
            out.prefills.append(self.prefills.pop(key))
            self._finish(key, "expired", posted=False)
        for key in [k for k, pr in self.registrations.items() if pr.post_by <= now]:
            pr = self.registrations.pop(key)
            out.registrations.append(pr)
            self._finish(key, "expired", posted=False)
            self._unfan(pr.reg.transfer_id, "expired")
        return out

    def _shape(self, transfer_id: str, siblings: tuple[str, ...]) -> tuple[str, ...]:
        """The flows a fanned-out transfer has here (waiting registrations' or the split
        prefill's); ``siblings`` when it has none yet."""
        if transfer_id in self._fan:
            return self._fan[transfer_id]
        if transfer_id in self._shares:
            return self._shares[transfer_id][1].keys
        return siblings

    def _unfan(self, transfer_id: str, status: str) -> None:
        """A fanned-out registration ended before its prefill came: when none of its
        siblings waits any more, the transfer is over (its D request has ended on
        every rank), so a prefill that comes now is dead at once, not held for its lease."""
        keys = self._fan.get(transfer_id)
        if keys is not None and not any(k in self.registrations for k in keys):
            del self._fan[transfer_id]
            self._finish(transfer_id, status, posted=False)

    def waiting_of(self, reply_to: bytes) -> tuple[int, int]:
        """(registrations, block ids) that the D worker ``reply_to`` has waiting here."""
        h = self.registrations.held.get(reply_to)
        return (h[0], h[1]) if h is not None else (0, 0)

    def take_refused(self) -> list[FinishedPrefill]:
        """Keyless prefills that a keyed registration displaced since the last call
        (see :func:`_prefill_refused`): the caller frees their blocks."""
        out, self._refused = self._refused, []
        return out

    # -- queries ----------------------------------------------------------
    def holder(self, transfer_id: str) -> str | None:
        """P request id whose finished prefill holds ``transfer_id`` now, if any."""
        fp = self.prefills.get(transfer_id)
        if fp is None and transfer_id in self._shares:
            fp = self._shares[transfer_id][0]
        if fp is None and transfer_id in self.active:
            fp = self.active[transfer_id].prefill
        return fp.request_id if fp is not None else None

    def registered_by(self, key: str) -> bytes | None:
        """The control identity of the D whose registration of flow ``key`` P holds."""
        pr = self.registrations.get(key)
        if pr is None and key in self.active:
            pr = self.active[key].registration
        return pr.reply_to if pr is not None else None

    def held_registrations(self) -> list[PendingRegistration]:
        """Registrations P holds (waiting for the prefill or being written): heartbeated."""
        return list(self.registrations.values()) + [m.registration for m in self.active.values()]

    def status_of(self, key: str) -> str | None:
        done = self._done.get(key)
        return done[0] if done is not None else None

    def final(self, key: str) -> tuple[str, bool] | None:
        """(final status, a WRITE was posted) of an ended flow, None otherwise."""
        return self._done.get(key)

    def idle(self) -> bool:
        return not (self.prefills or self.registrations or self.active)

    def _ended(self, key: str, by: bytes | None = None) -> bool:
        """``key`` ended here, as far as a prefill (``by`` None) or the D worker ``by``
        is concerned. A Cancel of a flow nobody had registered ended it for its sender
        only: another D's request, and a prefill (which then waits for its registration
        or its lease), are not ended by it."""
        if key not in self._done:
            return False
        canceller = self._cancelled_by.get(key)
        return canceller is None or canceller == by

    def _finish(self, key: str, status: str, posted: bool) -> None:
        self._done[key] = (status, posted)
        self._done.move_to_end(key)
        self._cancelled_by.pop(key, None)
        while len(self._done) > self._remember:
            old, _ = self._done.popitem(last=False)
            self._cancelled_by.pop(old, None)
            self.forgotten += 1
        if len(self.aborted) > self._remember:
            self.aborted.clear()
