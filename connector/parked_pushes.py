"""Pushes that wait for a lane: a D whose every lane is broken gets one reopened on the
writer's loop (:mod:`kvpath.connector.lane_setup`), and its pushes wait here meanwhile
instead of the writer reopening the lane in place (a probe can take seconds).

A waiting push is still matched (``state.active``): it ends exactly once, by going on
when a lane to its D is open again, or by failing (the reopen failed with no lane left,
D's ``post_by`` passed, P shuts down), or by D's Cancel (nothing was posted). Its
blocks are freed in every case but the first, where the WRITE takes them over. This
part only keeps the waiting list; the write loop decides (it starts or fails them).
"""

from __future__ import annotations

from kvpath.connector.push_state import Match
from kvpath.trace import TransferRecord

Parked = tuple[Match, TransferRecord]


class ParkedPushes:
    """D agent name -> the pushes waiting for a lane to it, oldest first."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Parked]] = {}

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __contains__(self, name: str) -> bool:
        return name in self.waiting

    def names(self) -> list[str]:
        """D agent names with a push waiting, in the order their first push came."""
        return list(self.waiting)

    def holds(self, key: str) -> bool:
        """A push of flow ``key`` waits here."""
        return any(m.prefill.key == key for parked in self.waiting.values() for m, _ in parked)

    def add(self, name: str, m: Match, rec: TransferRecord) -> None:
        self.waiting.setdefault(name, []).append((m, rec))

    def pop(self, name: str) -> list[Parked]:
        """All of D ``name``'s waiting pushes (they go on or fail now)."""
        return self.waiting.pop(name, [])

    def expire(self, now: float) -> list[Parked]:
        """Remove and return the waiting pushes whose D deadline (``post_by``) passed:
        their WRITE may no longer be posted, so they cannot wait for the lane any longer."""
        late_all: list[Parked] = []
        for name in list(self.waiting):
            waiting = self.waiting[name]
            late = [(m, rec) for m, rec in waiting if now >= m.registration.post_by]
            if not late:
                continue
            self.waiting[name] = [x for x in waiting if x not in late]
            if not self.waiting[name]:
                del self.waiting[name]
            late_all += late
        return late_all

    def take(self, key: str) -> Parked | None:
        """Remove the waiting push of flow ``key`` (D cancelled it: nothing was posted)."""
        for name, waiting in self.waiting.items():
            for i, (m, rec) in enumerate(waiting):
                if m.prefill.key == key:
                    del waiting[i]
                    if not waiting:
                        del self.waiting[name]
                    return m, rec
        return None
