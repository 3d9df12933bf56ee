"""The lane registry's changes, as the decision log keeps them for replay.

A placement may choose any registered (P, D) pair, so replaying it needs the registry as
it stood at that moment, not only the chosen pair's lanes. :class:`LaneLog` keeps every
change (a worker pair's lanes registered, or the pair removed), on the service's one
sequence of decisions and ends, in a window bounded by the lanes it holds (a change
weighs one plus its lanes: a caller alternating two large lane sets cannot grow it past
the bound). A change that leaves the window is folded into a base, one registration per
pair still registered, so the base and the window rebuild the registry as it stands at
any moment from the last folded change on (``complete_from_seq``); before that, the log
no longer knows it, and a replay says so rather than guess. A re-registration that
changes nothing (P's connectors register their lanes again every minute) is not a change.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["LaneLog", "MAX_LANE_LOG_LANES"]

MAX_LANE_LOG_LANES = 200_000  # lanes (and changes) the window holds, at most


class LaneLog:
    def __init__(self, max_lanes: int = MAX_LANE_LOG_LANES) -> None:
        self.window: deque[dict[str, Any]] = deque()
        self.max_lanes = max_lanes
        self.weight = 0  # the window's changes plus their lanes
        self.base: dict[tuple[str, str, str], dict[str, Any]] = {}  # (src, dst, worker) -> its last registration
        self.complete_from_seq = 0  # the registry is known at every sequence number from this one on

    @staticmethod
    def _weight(event: dict[str, Any]) -> int:
        return 1 + len(event["lanes"] or ())

    def record(self, event: dict[str, Any]) -> None:
        """One change: ``event`` has ``seq``, ``at``, ``src_host``, ``dst_host``, ``worker``,
        ``pair`` and ``lanes`` (None: the pair was removed)."""
        self.window.append(event)
        self.weight += self._weight(event)
        while self.weight > self.max_lanes and len(self.window) > 1:
            old = self.window.popleft()
            self.weight -= self._weight(old)
            key = (old["src_host"], old["dst_host"], old["worker"])
            if old["lanes"] is None:
                self.base.pop(key, None)
            else:
                self.base[key] = old
            self.complete_from_seq = old["seq"]

    def events(self) -> list[dict[str, Any]]:
        """The base and the window, in sequence order: all of it, whatever part of the
        decision log a replay takes (the registry at a decision is everything before it)."""
        return sorted(self.base.values(), key=lambda e: e["seq"]) + list(self.window)

    def __len__(self) -> int:
        return len(self.base) + len(self.window)
