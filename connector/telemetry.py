"""Per-transfer telemetry records, counters and the JSONL trace writer."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class TransferRecord:
    """One push, seen from P. Times are wall-clock seconds (time.time())."""

    transfer_id: str
    request_id: str  # P's request id
    peer_engine: str = ""
    peer_request_id: str = ""  # D's request id
    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    lane: int = -1
    src_port: int = 0
    lease_id: str = ""  # the path reservation this push used, if any
    registered_at: float | None = None  # D's registration arrived
    prefill_done_at: float | None = None  # P's request finished
    submit_at: float | None = None  # WRITE posted
    first_byte_at: float | None = None  # not observable through NIXL/UCX: stays None
    completed_at: float | None = None
    status: str = "ok"  # ok | failed | expired | cancelled | rejected
    detail: str = ""

    @property
    def duration_s(self) -> float | None:
        if self.submit_at is None or self.completed_at is None:
            return None
        return self.completed_at - self.submit_at

    def to_json(self) -> str:
        d = asdict(self)
        d["kind"] = "kv_transfer"
        d["duration_s"] = self.duration_s
        return json.dumps(d, sort_keys=True)


class TraceWriter:
    """Appends records as JSON lines; safe to call from several threads."""

    def __init__(self, path: str | None):
        self.path = path.replace("{pid}", str(os.getpid())) if path else None
        self._lock = threading.Lock()
        self._fh = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)

    def write(self, rec: TransferRecord) -> None:
        if self._fh is None:
            return
        with self._lock:
            self._fh.write(rec.to_json() + "\n")

    def write_event(self, kind: str, **fields: Any) -> None:
        if self._fh is None:
            return
        with self._lock:
            self._fh.write(json.dumps({"kind": kind, **fields}, sort_keys=True) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._fh:
                self._fh.close()
                self._fh = None


COUNTERS = (
    "pushes_ok",
    "pushes_failed",
    "pushes_expired",
    "pushes_cancelled",
    "registrations",
    "registrations_rejected",
    "registrations_duplicate",
    "messages_malformed",
    "recv_ok",
    "recv_failed",
    "recv_timeout",
    "lanes_opened",
    "lanes_torn_down",
    "prefills_duplicate",
    "handshakes",
    "handshakes_refused",
    "peer_restarts",
    "control_send_failed",
    "fence_drain_releases",
    "pushes_slow",
    "engine_thread_errors",
    "reservation_calls_ok",
    "reservation_calls_failed",
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
