"""D-side bookkeeping of registered requests waiting for their push (pure logic).

Each registered request ends exactly once: received (the NIXL notification came),
failed (P rejected it, the push failed, or the watchdog fired), or, when D itself
gave up (abort), released once it is safe to reuse its blocks: P acknowledged the
cancel, the push landed anyway, or the watchdog fired.
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
    deadline: float
    cancelled: bool = False


class ReceiverState:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self.by_tid: dict[str, Waiting] = {}
        self.finished: set[str] = set()  # request ids: blocks hold the KV (or are free to release)
        self.failed: set[str] = set()  # request ids whose KV did not arrive
        self.early_done: set[str] = set()  # notification before our own registration (rare)

    def add(self, request_id: str, transfer_id: str, peer: str) -> bool:
        if transfer_id in self.by_tid:
            return False
        if transfer_id in self.early_done:
            self.early_done.discard(transfer_id)
            self.finished.add(request_id)
            return True
        self.by_tid[transfer_id] = Waiting(request_id, transfer_id, peer, self.clock() + self.timeout_s)
        return True

    def on_done(self, transfer_id: str) -> Waiting | None:
        w = self.by_tid.pop(transfer_id, None)
        if w is None:
            if len(self.early_done) > 65536:  # stray notifications must not grow without bound
                self.early_done.clear()
            self.early_done.add(transfer_id)
            return None
        self.finished.add(w.request_id)
        return w

    def on_failed(self, transfer_id: str) -> Waiting | None:
        w = self.by_tid.pop(transfer_id, None)
        if w is None:
            return None
        self.finished.add(w.request_id)
        if not w.cancelled:
            self.failed.add(w.request_id)
        return w

    def cancel_request(self, request_id: str) -> Waiting | None:
        for w in self.by_tid.values():
            if w.request_id == request_id:
                w.cancelled = True
                return w
        return None

    def expire(self) -> list[Waiting]:
        now = self.clock()
        out = [w for w in self.by_tid.values() if w.deadline <= now]
        for w in out:
            del self.by_tid[w.transfer_id]
            self.finished.add(w.request_id)
            if not w.cancelled:
                self.failed.add(w.request_id)
        return out

    def take(self) -> tuple[set[str], set[str]]:
        """(finished, failed) since the last call; failed is a subset of finished."""
        f, x = self.finished, self.failed
        self.finished, self.failed = set(), set()
        return f, x

    def pending(self) -> int:
        return len(self.by_tid)
