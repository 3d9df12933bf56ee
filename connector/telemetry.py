"""The connector's counters and per-step statistics. Its per-transfer records are the
trace schema's (:class:`kvpath.trace.TransferRecord`), written through
:class:`kvpath.trace.TraceWriter`."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvpath.trace import TransferRecord

logger = logging.getLogger(__name__)


COUNTERS = (
    "pushes_ok",
    "pushes_failed",
    "pushes_expired",
    "pushes_cancelled",
    "registrations",
    "registrations_rejected",
    "registrations_duplicate",
    "messages_malformed",
    "messages_unbound",
    "peers_refused",
    "peers_untrusted",
    "transfer_key_mismatch",
    "control_disconnects",
    "recv_ok",
    "recv_failed",
    "recv_timeout",
    "liveness_held_by_transport",
    "lanes_opened",
    "lanes_torn_down",
    "prefills_duplicate",
    "prefills_refused",
    "registrations_over_limit",
    "handshakes",
    "handshakes_refused",
    "peer_restarts",
    "control_send_failed",
    "fence_drain_releases",
    "fence_bound_releases",
    "acks_ignored",
    "notifs_stray",
    "pushes_slow",
    "engine_thread_errors",
    "trace_write_failed",
    "reservation_calls_ok",
    "reservation_calls_failed",
    "lanes_reserved_at_push",
    "lanes_reserve_fallback",
    "leases_updated",  # a layer-wise push's own lease told its whole bytes and expected end
    "pushes_queued",  # uplink_pushes: a push waited for an uplink slot
    "pushes_queue_overdue",  # ... and started without one when its wait reached its bound
    "peers_forgotten",
    "peers_over_limit",
    "peers_aliased",  # D: one P process answered at two addresses (its requests time out)
    "lane_registrations_skipped",
    "worker_pair_collisions",
    "kv_verify_ok",
    "kv_verify_mismatch",
    "kv_verify_skipped",
    # push_granularity=layer: pushes committed layer-wise, their WRITEs, layers and bytes,
    # and the bytes that landed before P's prefill ended (layers per WRITE, overlap share)
    "pushes_layered",
    "layer_writes",
    "layers_pushed",
    "layer_bytes",
    "layer_overlap_bytes",
    "layer_restarts",
)


@dataclass
class StatsWindow:
    """What happened since the last snapshot (sent to vLLM every step)."""

    counters: dict[str, int] = field(default_factory=dict)
    transfer_s: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.counters and not self.transfer_s


class Stats:
    """Thread-safe counters: cumulative totals plus a window drained by vLLM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, int] = {k: 0 for k in COUNTERS}
        self._win = StatsWindow()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.totals[name] = self.totals.get(name, 0) + n
            self._win.counters[name] = self._win.counters.get(name, 0) + n

    def observe_transfer(self, rec: TransferRecord) -> None:
        with self._lock:
            if rec.duration_s is not None:
                self._win.transfer_s.append(rec.duration_s)
            self._win.bytes.append(rec.bytes)
            self._win.descriptors.append(rec.descriptors)

    def take_window(self) -> StatsWindow | None:
        with self._lock:
            if self._win.is_empty():
                return None
            w, self._win = self._win, StatsWindow()
            return w

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)
