"""Best-effort calls from P's connector to the reservation service.

The writer thread must never wait on HTTP: it queues the call here and a small
thread posts it (lane registrations when lanes open, releases when pushes end); a
second thread asks for lanes (reserve_at=push) and hands the answer back.
A service that is down only costs a counter and a debug log line; leases end
reservations whose release never arrives. :class:`ReservationNotifier` is the
:class:`~kvpath.reservation.wire.QueuedReserver` shape; its bodies are the wire's types.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import msgspec

from kvpath.credentials import CredentialError, header_safe, load_secret
from kvpath.reservation import wire
from kvpath.reservation.wire import LaneInfo, ReservedCallback

logger = logging.getLogger(__name__)


def reservation_token(cfg: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """The reservation service's token for P's connector (``cfg``: its KVPathConfig):
    the file ``reservation_token_file`` names, else the deprecated literal
    ``reservation_token`` knob (with a warning: a knob of kv_connector_extra_config is
    on vLLM's command line and in its "non-default args" log line), else the
    environment variable ``KVPATH_RESERVATION_TOKEN``. A bad file, or a token that is
    not one word of printable ASCII, raises :class:`~kvpath.credentials.CredentialError`
    naming where it came from. The token itself is never logged."""
    if cfg.reservation_token and not cfg.reservation_token_file:
        logger.warning("kv_connector_extra_config.reservation_token is deprecated: it puts the token on vLLM's "
                       "command line and in its log; use reservation_token_file (a 0600 file) or %s", wire.TOKEN_ENV)
        token, field = cfg.reservation_token, "kv_connector_extra_config.reservation_token"
    else:
        field = "kv_connector_extra_config.reservation_token_file" if cfg.reservation_token_file else wire.TOKEN_ENV
        token = load_secret(field, cfg.reservation_token_file, wire.TOKEN_ENV,
                            None if environ is None else dict(environ))
    if token is not None and not header_safe(token):
        raise CredentialError(f"{field}: a token must be one word of printable ASCII (it travels in an HTTP header)")
    return token


class _Call(NamedTuple):
    path: str  # a route of kvpath.reservation.wire
    # encoded on the notifier's thread
    body: wire.ReserveRequest | wire.ReleaseRequest | wire.LeaseUpdate | wire.LanesRequest | wire.LanesRemoval
    done: ReservedCallback | None = None  # reserve calls only


def _lane(row: LaneInfo | tuple[int, int] | Mapping[str, Any]) -> LaneInfo:
    if isinstance(row, LaneInfo):
        return row
    if isinstance(row, Mapping):
        return msgspec.convert(row, LaneInfo)
    return LaneInfo(row[0], row[1])


class Counters(Protocol):
    """Where the notifier counts its calls (P's connector passes its telemetry)."""

    def inc(self, name: str, n: int = 1) -> None: ...


class _Counts:
    """The notifier's own counts when no one passes counters (tests, tools): ``totals``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: defaultdict[str, int] = defaultdict(int)  # a count never made reads 0

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.totals[name] += n


class ReservationNotifier:
    def __init__(self, base_url: str, stats: Counters | None = None, timeout_s: float = 1.0,
                 token: str | None = None):
        """``token``: the service's token, sent with every call (the service refuses
        them without it); see :func:`reservation_token`."""
        self.base_url = base_url.rstrip("/")
        self.stats: Counters = stats if stats is not None else _Counts()
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._q: queue.Queue[_Call | None] = queue.Queue(maxsize=10000)
        # reserve calls get their own thread: a push must not wait behind registrations
        # and releases (up to timeout_s each when the service is down)
        self._rq: queue.Queue[_Call | None] = queue.Queue(maxsize=10000)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"kvpath-reservation-{n}", daemon=True)
                         for q, n in ((self._q, "notifier"), (self._rq, "reserver"))]
        for t in self._threads:
            t.start()

    def register_lanes(
        self, src_host: str, dst_host: str, lanes: Sequence[LaneInfo | tuple[int, int] | Mapping[str, Any]],
        worker: str = "", pair: wire.WorkerPair | None = None,
    ) -> None:
        """``lanes``: LaneInfo 5-tuples, (lane id, source port) pairs, or dicts of
        LaneInfo's fields. ``pair`` (or a free-form ``worker``) names the (P worker,
        D worker) pair, so pairs of one host pair never overwrite each other."""
        try:
            rows = [_lane(x) for x in lanes]
        except (msgspec.ValidationError, TypeError, IndexError) as e:  # never raise into the writer
            self.stats.inc("reservation_calls_failed")
            logger.warning("lanes not registered: %s", e)
            return
        # the pair's name as ``worker`` too: a service from before pairs keys it by that
        worker = worker or (pair.key() if pair is not None else "")
        self._post(_Call(wire.LANES_PATH, wire.LanesRequest(src_host=src_host, dst_host=dst_host, worker=worker,
                                                            lanes=rows, pair=pair)))

    def unregister_lanes(self, src_host: str, dst_host: str, worker: str = "", pair: wire.WorkerPair | None = None) -> None:
        worker = worker or (pair.key() if pair is not None else "")
        self._post(_Call(wire.UNREGISTER_PATH, wire.LanesRemoval(src_host=src_host, dst_host=dst_host, worker=worker,
                                                                 pair=pair)))

    def release(self, lease_id: str) -> None:
        self._post(_Call(wire.RELEASE_PATH, wire.ReleaseRequest(lease_id)))

    def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> None:
        """A live lease's flow, better known (its bytes, when it expects to end): queued
        behind the registrations and releases before it, so never ahead of the lease's
        own release."""
        self._post(_Call(wire.LEASE_PATH, wire.LeaseUpdate(lease_id=lease_id, bytes=nbytes,
                                                           expected_end_s=expected_end_s)))

    def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                transfer_id: str = "", scope: wire.FlowScope | None = None, *, done: ReservedCallback) -> None:
        """Ask for a lane now; ``done(transfer_id, lane, lease_id)`` is called from the
        notifier's thread with the answer, or with (None, None) when there is none
        (at once, from this thread, when the queue is full)."""
        req = wire.ReserveRequest(src_host=src_host, dst_host=dst_host, bytes=nbytes,
                                  lanes=list(lanes) if lanes else None, transfer_id=transfer_id, scope=scope)
        try:
            self._rq.put_nowait(_Call(wire.RESERVE_PATH, req, done))
        except queue.Full:
            self.stats.inc("reservation_calls_failed")
            done(transfer_id, None, None)

    def _post(self, call: _Call) -> None:
        try:
            self._q.put_nowait(call)
        except queue.Full:
            self.stats.inc("reservation_calls_failed")

    def close(self, flush_s: float = 2.0) -> None:
        """Send what is queued for up to ``flush_s`` (releases, lane removals), then stop
        the threads; never blocks on a full queue. Calls left then are dropped: the
        service's leases expire by themselves."""
        for q in (self._q, self._rq):
            try:
                q.put_nowait(None)  # after the backlog: the thread ends when it gets there
            except queue.Full:
                pass
        deadline = time.monotonic() + flush_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()  # a backlog left (the service slow or down): stop after the current call
        for t in self._threads:
            t.join(timeout=self.timeout_s + 1.0)

    def _run(self, q: "queue.Queue[_Call | None]") -> None:
        import httpx

        headers = {**self._headers, "content-type": "application/json"}
        with httpx.Client(timeout=self.timeout_s, headers=headers) as client:
            if q is self._rq:  # open the connection now: the first push should not pay for it
                try:
                    client.get(self.base_url + wire.HEALTH_PATH)
                except Exception:
                    pass
            while not self._stop.is_set():
                try:
                    call = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                if call is None:
                    return
                lane = lease = None
                try:
                    r = client.post(self.base_url + call.path, content=wire.encode(call.body))
                    if r.status_code >= 400:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    self.stats.inc("reservation_calls_ok")
                    if call.done is not None:
                        ans = wire.decode_answer(r.content)
                        lane, lease = ans.lane, ans.lease_id or None
                        if lane is None and lease:  # a fallback ("no_lanes"): nothing to hold
                            self._post(_Call(wire.RELEASE_PATH, wire.ReleaseRequest(lease)))
                            lease = None
                except Exception as e:  # the service is optional: count and go on
                    self.stats.inc("reservation_calls_failed")
                    logger.debug("reservation service call %s failed: %s", call.path, e)
                if call.done is not None and isinstance(call.body, wire.ReserveRequest):
                    try:
                        call.done(call.body.transfer_id, lane, lease)
                    except Exception:  # the writer's callback must not kill this thread
                        logger.exception("reservation callback failed")
