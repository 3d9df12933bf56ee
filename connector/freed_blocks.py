"""P requests whose blocks the engine may free: the end of every push, whichever way it
ended, passes through :meth:`FreedBlocks.release`. A prefill fanned out to several D
ranks frees its blocks at its last flow's end, once; the reservation asked for a flow
ends with the flow, the one a request came with after its blocks are freed."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

from kvpath.connector.push_state import FinishedPrefill, SenderState
from kvpath.reservation.notifier import ReservationNotifier

logger = logging.getLogger(__name__)

# P request ids remembered as reported, so a late second end never reports one twice
# (vLLM frees and forgets a request on its first report)
REMEMBER_RELEASED = 65536


class FreedBlocks:
    """Written by the writer thread, taken by the engine thread (under a lock)."""

    def __init__(self, state: SenderState, on_ready: Callable[[], None]):
        self.state = state
        self.notifier: ReservationNotifier | None = None  # set by the sender's start()
        self._on_ready = on_ready  # wakes the engine: a result is ready
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._reported: OrderedDict[str, None] = OrderedDict()

    def release(self, fp: FinishedPrefill) -> None:
        """The push of flow ``fp`` ended (any way): end the reservation asked for it; at
        the prefill's last flow free its blocks and end the reservation it came with."""
        last = self.state.flow_ended(fp)
        if fp.lane_asked and fp.lease_id:  # this flow's own
            self._end_lease(fp)
        if not last:
            return
        p = fp.progress
        if p is not None and not (p.final or p.aborted):
            # a layer-wise push ended while its request still computes: vLLM must not free
            # a running request's blocks; they are reported when the request ends
            p.blocks_released = True
        else:
            self.report(fp.request_id)
        if fp.lease_id and not fp.lane_asked:  # after the blocks: it must not keep them
            self._end_lease(fp)

    def request_ended(self, fp: FinishedPrefill) -> None:
        """A layer-wise prefill's request finished or was aborted: blocks its flows have
        all released already are reported now."""
        if fp.progress is not None and fp.progress.blocks_released:
            self.report(fp.request_id)

    def report(self, request_id: str) -> None:
        """P request ``request_id``'s blocks may be freed (once; a second report is dropped)."""
        if request_id not in self._reported:
            self._reported[request_id] = None
            if len(self._reported) > REMEMBER_RELEASED:
                self._reported.popitem(last=False)
            with self._lock:
                self._finished.add(request_id)
            self._on_ready()

    def _end_lease(self, fp: FinishedPrefill) -> None:
        if self.notifier is None:
            return
        try:
            self.notifier.release(fp.lease_id)
        except Exception:
            logger.exception("releasing the reservation of %s failed", fp.transfer_id)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._finished)

    def take(self) -> set[str]:
        """P request ids whose blocks may be freed (pushed, failed or expired)."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out
