"""Best-effort calls from P's connector to the reservation service.

The writer thread must never wait on HTTP: it queues the call here and a small
thread posts it (lane registrations when lanes open, releases when pushes end); a
second thread asks for lanes (reserve_at=push) and hands the answer back.
A service that is down only costs a counter and a debug log line; leases end
reservations whose release never arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from kvpath.connector.telemetry import Stats

logger = logging.getLogger(__name__)


class ReservationNotifier:
    def __init__(self, base_url: str, stats: Stats | None = None, timeout_s: float = 1.0, token: str | None = None):
        """``token``: the service's admin token, which lane registrations need when it has one."""
        self.base_url = base_url.rstrip("/")
        self.stats = stats or Stats()
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._q: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=10000)
        # reserve calls get their own thread: a push must not wait behind registrations
        # and releases (up to timeout_s each when the service is down)
        self._rq: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=10000)
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"kvpath-reservation-{n}", daemon=True)
                         for q, n in ((self._q, "notifier"), (self._rq, "reserver"))]
        for t in self._threads:
            t.start()

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

    def reserve(self, src_host: str, dst_host: str, nbytes: int, transfer_id: str,
                done: Callable[[str, int | None, str | None], None]) -> None:
        """Ask for a lane now; ``done(transfer_id, lane, lease_id)`` is called from the
        notifier's thread with the answer, or with (None, None) when there is none."""
        body = {"src_host": src_host, "dst_host": dst_host, "bytes": nbytes, "transfer_id": transfer_id}
        try:
            self._rq.put_nowait(("/v1/reserve", dict(body, _done=done)))
        except queue.Full:
            self.stats.inc("reservation_calls_failed")
            done(transfer_id, None, None)

    def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            self._q.put_nowait((path, body))
        except queue.Full:
            self.stats.inc("reservation_calls_failed")

    def close(self) -> None:
        for q in (self._q, self._rq):
            q.put(None)
        for t in self._threads:
            t.join(timeout=3)

    def _run(self, q: "queue.Queue[tuple[str, dict[str, Any]] | None]") -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, headers=self._headers) as client:
            if q is self._rq:  # open the connection now: the first push should not pay for it
                try:
                    client.get(self.base_url + "/health")
                except Exception:
                    pass
            while True:
                item = q.get()
                if item is None:
                    return
                path, body = item
                done = body.pop("_done", None)
                lane = lease = None
                try:
                    r = client.post(self.base_url + path, json=body)
                    if r.status_code >= 400:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    self.stats.inc("reservation_calls_ok")
                    if done is not None:
                        ans = r.json()
                        lane, lease = ans.get("lane"), ans.get("lease_id")
                        if lane is None and lease:  # a fallback ("no_lanes"): nothing to hold
                            self._post("/v1/release", {"lease_id": lease})
                            lease = None
                except Exception as e:  # the service is optional: count and go on
                    self.stats.inc("reservation_calls_failed")
                    logger.debug("reservation service call %s failed: %s", path, e)
                if done is not None:
                    try:
                        done(body["transfer_id"], lane, lease)
                    except Exception:  # the writer's callback must not kill this thread
                        logger.exception("reservation callback failed")
