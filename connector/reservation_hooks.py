"""Best-effort calls from P's connector to the reservation service.

The writer thread must never wait on HTTP: it queues the call here and a small
thread posts it (lane registrations when lanes open, releases when pushes end).
A service that is down only costs a counter and a debug log line; leases end
reservations whose release never arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from connector.telemetry import Stats

logger = logging.getLogger(__name__)


class ReservationNotifier:
    def __init__(self, base_url: str, stats: Stats | None = None, timeout_s: float = 1.0, token: str | None = None):
        """``token``: the service's admin token, which lane registrations need when it has one."""
        self.base_url = base_url.rstrip("/")
        self.stats = stats or Stats()
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._q: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=10000)
        self._thread = threading.Thread(target=self._run, name="kvpath-reservation-notifier", daemon=True)
        self._thread.start()

    def register_lanes(
        self, src_host: str, dst_host: str, lanes: list[tuple[int, int]] | list[dict[str, Any]], worker: str = ""
    ) -> None:
        """``lanes``: (lane id, source port) pairs, or dicts with the full 5-tuple
        (lane, src_ip, src_port, dst_ip, dst_port, proto). ``worker`` names the
        (P worker, D worker) pair, so pairs of one host pair never overwrite each other."""
        rows = [x if isinstance(x, dict) else {"lane": x[0], "src_port": x[1]} for x in lanes]
        self._post("/v1/lanes", {"src_host": src_host, "dst_host": dst_host, "worker": worker, "lanes": rows})

    def release(self, lease_id: str) -> None:
        self._post("/v1/release", {"lease_id": lease_id})

    def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            self._q.put_nowait((path, body))
        except queue.Full:
            self.stats.inc("reservation_calls_failed")

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=3)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, headers=self._headers) as client:
            while True:
                item = self._q.get()
                if item is None:
                    return
                path, body = item
                try:
                    r = client.post(self.base_url + path, json=body)
                    if r.status_code >= 400:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    self.stats.inc("reservation_calls_ok")
                except Exception as e:  # the service is optional: count and go on
                    self.stats.inc("reservation_calls_failed")
                    logger.debug("reservation service call %s failed: %s", path, e)
