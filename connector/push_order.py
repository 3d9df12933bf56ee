"""P's pushes at the sending NIC: how many may be in flight on this host's uplink at once,
over every TP rank and every engine on the host, and in what order the others start.

All pushes of a host leave through one uplink; started all at once they share it and all
finish late. With ``uplink_pushes`` N > 0 a whole push posts its WRITE only while it holds
one of N host-wide slots, and the pushes waiting for one start in ``push_order``: ``fifo``
(as they were matched) or ``srpt`` (the fewest bytes first, so short pushes do not wait
behind long ones).

The slots are N lock files (``uplink_slots_dir``, one set per ``fabric_host``), each held
with ``flock`` by the process whose push holds it: every process on the host sees the
same slots, and the kernel releases a dead process's locks with it, so a crashed engine
never keeps a slot. A push waits at most ``push_queue_max_wait_s``, and never past
``QUEUE_MARGIN_S`` before D's post_by: then it starts without a slot (counted as
overdue), so the queue never makes a push miss its deadline, and D keeps getting the
heartbeats of every matched push meanwhile. Layer-wise pushes do not wait here: their
WRITEs follow the forward. Writer thread only.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import stat
from dataclasses import dataclass

from kvpath.layer_push import PUSH_ORDERS
from kvpath.connector.push_state import Match

logger = logging.getLogger(__name__)
QUEUE_MARGIN_S = 1.0  # a waiting push starts this long before D's post_by at the latest
MAX_UPLINK_PUSHES = 64


class UplinkSlots:
    """``n`` host-wide slots: one lock file each, in this user's own 0700 folder under
    ``directory``, named for ``host``. Another user can neither hold our slots (the folder
    is ours) nor point us elsewhere (no symlink is followed); anything else raises OSError."""

    def __init__(self, host: str, n: int, directory: str):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", host or "local")[:64]
        self._fds: list[int] = []
        self._held: set[int] = set()
        folder = _own_folder(os.path.join(directory, f"kvpath-uplink-{os.getuid()}"))
        try:
            for k in range(n):
                fd = os.open(os.path.join(folder, f"{name}-{k}.lock"),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._fds.append(fd)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    raise PermissionError(f"{folder}: {name}-{k}.lock is not a file of ours")
        except OSError:
            self.close()
            raise

    def take(self) -> int | None:
        """A free slot, now held (None: every slot is held, here or by another process)."""
        for k, fd in enumerate(self._fds):
            if k in self._held:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # (BlockingIOError: another process holds it)
                continue
            self._held.add(k)
            return k
        return None

    def give(self, k: int) -> None:
        if k in self._held:
            self._held.discard(k)
            fcntl.flock(self._fds[k], fcntl.LOCK_UN)

    def held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # (closing drops its lock)
            except OSError:
                pass
        self._fds, self._held = [], set()


def _own_folder(path: str) -> str:
    """``path``, a folder of this user's with no access for others (made if missing)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a folder of this user's alone")
    return path


@dataclass
class _Waiting:
    m: Match
    nbytes: int
    since: float
    seq: int


class PushQueue:
    """Whole pushes waiting for an uplink slot (see the module). ``slots`` None: no cap."""

    def __init__(self, order: str, slots: UplinkSlots | None, max_wait_s: float):
        if order not in PUSH_ORDERS:
            raise ValueError(f"push_order must be one of {PUSH_ORDERS}, got {order!r}")
        self.order, self.slots, self.max_wait_s = order, slots, max_wait_s
        self._waiting: dict[str, _Waiting] = {}  # flow key -> its wait
        self._slot_of: dict[str, int] = {}  # flow key -> the slot its push holds
        self._cleared: set[str] = set()  # flow keys whose start is cleared (slot held, or overdue)
        self._seq = itertools.count()

    @property
    def active(self) -> bool:
        return self.slots is not None

    def __len__(self) -> int:
        return len(self._waiting)

    def admit(self, m: Match, nbytes: int, now: float) -> bool:
        """May push ``m`` (``nbytes``) post its WRITE now? Yes without a cap, once
        :meth:`ready` cleared it, or when nothing waits and a slot is free (it holds it
        then); else it waits (False) for :meth:`ready`."""
        key = m.prefill.key
        if self.slots is None:
            return True
        if key in self._cleared or key in self._slot_of:  # cleared by ready(), or holds its slot already
            self._cleared.discard(key)
            return True
        if key in self._waiting:
            return False
        if not self._waiting:
            k = self.slots.take()
            if k is not None:
                self._slot_of[key] = k
                return True
        self._waiting[key] = _Waiting(m, nbytes, now, next(self._seq))
        return False

    def ready(self, now: float) -> list[tuple[Match, bool]]:
        """The waiting pushes that may start now, in order: (push, overdue). Those with a
        slot first (each now holds it), then those whose wait reached its bound."""
        if not self._waiting:
            return []
        out: list[tuple[Match, bool]] = []
        key_of = (lambda w: (w.nbytes, w.seq)) if self.order == "srpt" else (lambda w: w.seq)
        free = True  # after the first miss, no slot is tried again this time (each try is a syscall)
        for w in sorted(self._waiting.values(), key=key_of):
            key = w.m.prefill.key
            k = self.slots.take() if free and self.slots is not None else None
            free = k is not None
            overdue = k is None and (now - w.since >= self.max_wait_s
                                     or now >= w.m.registration.post_by - QUEUE_MARGIN_S)
            if k is None and not overdue:
                continue
            del self._waiting[key]
            if k is not None:
                self._slot_of[key] = k
            self._cleared.add(key)
            out.append((w.m, overdue))
        return out

    def take(self, key: str) -> Match | None:
        """Push ``key`` leaves the queue without starting (D cancelled it): None if not waiting."""
        w = self._waiting.pop(key, None)
        return w.m if w is not None else None

    def holds(self, key: str) -> bool:
        return key in self._waiting

    def waiting(self) -> list[Match]:
        return [w.m for w in self._waiting.values()]

    def done(self, key: str) -> None:
        """Push ``key`` ended (any way): its slot is free for the next."""
        self._cleared.discard(key)
        k = self._slot_of.pop(key, None)
        if k is not None and self.slots is not None:
            self.slots.give(k)

    def drop_all(self) -> list[Match]:
        """Shutdown: the waiting pushes (to fail), every slot given back."""
        out = [w.m for w in self._waiting.values()]
        self._waiting.clear()
        for key in list(self._slot_of):
            self.done(key)
        if self.slots is not None:
            self.slots.close()
        return out
