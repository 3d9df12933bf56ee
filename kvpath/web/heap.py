"""The garbage collector in a long-running service: the start-up heap set aside.

A full collection walks every tracked object. In a service that has imported FastAPI,
pydantic, numpy and its own modules that is tens of thousands of objects that live as
long as the process, and walking them stalls every request in flight: 20-70 ms on
these machines, the reservation service's p99 at 1,000 pairs/s (docs/results.md,
section 16). ``gc.freeze()`` moves what exists at start-up out of the collector's
generations (Python's documented use: "before a POSIX fork() call or at start-up");
what the service builds later is collected as before, and the long-lived objects it
builds per registered lane are untracked types (kvpath.fabric.Path,
kvpath.reservation.lane_registry)."""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once (no garbage is frozen), then freeze what is left; returns how many
    objects the collector no longer walks."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.debug("start-up heap frozen: %d objects", n)
    return n
