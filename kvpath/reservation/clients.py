"""How the proxy asks for a lane: in-process service or HTTP, with a short timeout.

Both are :class:`~kvpath.reservation.wire.AsyncReserver`. A reservation that does
not come back in time (service down, slow, no lanes known) is a *fallback*: the P
connector then takes the hash-chosen lane, and the reason is counted. Requests
never wait long on the reservation service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import aiohttp
import msgspec

from kvpath.reservation import wire
from kvpath.placement import CostModel, PlacementError
from kvpath.reservation.decisions import ReservationError, ReservationService, SyncReserver
from kvpath.reservation.placer import place_request
from kvpath.reservation.wire import FlowScope, LaneGrant, LaneInfo

logger = logging.getLogger(__name__)
# below uvicorn's keep-alive (5 s): the client, not the service, closes an idle connection
IDLE_KEEPALIVE_S = 2.0
RELEASE_BATCH_S = 0.005  # how long a release waits for others to go with it
MAX_PENDING_RELEASES = 65536


class InProcessReserver:
    """The service in the proxy's own process (``--reservation inproc``). ``cost``: the
    placement's cost model (None: ``place`` answers None, as a service without one)."""

    def __init__(self, svc: SyncReserver, cost: CostModel | None = None):
        self.svc = svc
        self.cost = cost

    async def place(self, req: wire.PlaceRequest) -> wire.PlaceAnswer | str:
        """P, D and the lane at once, or why not (``not_configured``, ``rejected: ...``:
        nothing was reserved; the caller picks and reserves as it would without)."""
        if self.cost is None or not isinstance(self.svc, ReservationService):
            return "not_configured"
        try:
            return place_request(self.svc, self.cost, req)
        except (PlacementError, ReservationError) as e:
            return f"rejected: {e}"

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                      transfer_id: str = "", scope: FlowScope | None = None) -> LaneGrant:
        try:
            r = self.svc.reserve(src_host, dst_host, nbytes, lanes, transfer_id, scope)
        except ReservationError as e:
            return LaneGrant(fallback=f"rejected: {e}")
        if r.fallback:
            return LaneGrant(fallback=r.fallback)
        return LaneGrant(r.lane, r.lease_id, r.path.spine if r.path else None)

    async def release(self, lease_id: str) -> None:
        self.svc.release(lease_id)

    async def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> bool:
        try:
            return self.svc.update(lease_id, nbytes, expected_end_s) is not None
        except (ReservationError, TypeError):
            return False

    async def close(self) -> None:
        return None


class HttpReserver:
    """A ``kvpath reservation`` service (``--reservation-url``). ``token``: the
    service's token, sent as ``Authorization: Bearer`` with every call (the service
    refuses reserve and release without it: ``http_401``, ``http_403``).

    aiohttp on keep-alive connections (at most 64), made on first use in the caller's
    loop: at a thousand reservations a second httpx's client took several times the
    service's own CPU per call (docs/results.md, section 15)."""

    def __init__(self, url: str, timeout_s: float = 0.05, token: str | None = None):
        self.url = url.rstrip("/")
        self.headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._releases: list[str] = []  # lease ids to release in the next call
        self._flusher: asyncio.Task | None = None
        self._one_by_one = False  # the service has no /v1/releases

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one call; raises asyncio.TimeoutError past the timeout and
        aiohttp.ClientError when the service cannot be reached or cuts the answer."""
        if self._session is None or self._session.closed or self._loop is not asyncio.get_running_loop():
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=IDLE_KEEPALIVE_S),
                headers=self.headers, timeout=self.timeout, auto_decompress=False)
        async with self._session.post(self.url + path, data=body) as r:
            return r.status, await r.read()

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                      transfer_id: str = "", scope: FlowScope | None = None) -> LaneGrant:
        req = wire.ReserveRequest(src_host=src_host, dst_host=dst_host, bytes=nbytes,
                                  lanes=list(lanes) if lanes else None, transfer_id=transfer_id, scope=scope)
        try:
            status, content = await self._post(wire.RESERVE_PATH, wire.encode(req))
        except asyncio.TimeoutError:
            return LaneGrant(fallback="timeout")
        except aiohttp.ClientError:
            return LaneGrant(fallback="unreachable")
        if status != 200:
            return LaneGrant(fallback=f"http_{status}")
        try:
            return LaneGrant.of(wire.decode_answer(content))
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # (ValidationError included)
            return LaneGrant(fallback="bad_answer")

    async def release(self, lease_id: str) -> None:
        """Queued, and sent with the others released within ``RELEASE_BATCH_S`` in one call
        (``/v1/releases``): a release only lowers the loads, so one a few milliseconds late
        decides nothing wrong, and at a thousand requests a second it halves the calls.
        Past ``MAX_PENDING_RELEASES`` (the service unreachable) the oldest are dropped:
        their leases end them."""
        self._releases.append(lease_id)
        if len(self._releases) > MAX_PENDING_RELEASES:
            del self._releases[:len(self._releases) - MAX_PENDING_RELEASES]
        loop = asyncio.get_running_loop()
        if self._flusher is None or self._flusher.done() or self._flusher.get_loop() is not loop:
            self._flusher = loop.create_task(self._flush_releases())

    async def _flush_releases(self) -> None:
        await asyncio.sleep(RELEASE_BATCH_S)
        while self._releases:
            batch, self._releases = self._releases[:wire.MAX_RELEASES], self._releases[wire.MAX_RELEASES:]
            try:
                if self._one_by_one:
                    for lease_id in batch:
                        await self._post(wire.RELEASE_PATH, wire.encode(wire.ReleaseRequest(lease_id)))
                    continue
                status, _ = await self._post(wire.RELEASES_PATH, wire.encode(wire.ReleasesRequest(batch)))
                if status in (404, 405):  # a service older than /v1/releases: one call each from now on
                    logger.warning("%s has no %s: releasing one lease per call", self.url, wire.RELEASES_PATH)
                    self._one_by_one = True
                    self._releases[:0] = batch
                elif status != 200:
                    logger.warning("%s answered %d to %d releases (their leases end them)", self.url, status,
                                   len(batch))
            except (asyncio.TimeoutError, aiohttp.ClientError):
                pass  # the leases end them anyway

    async def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> bool:
        """True when the service updated the live lease; False for every fault (best effort:
        the reservation keeps its first bytes and its lease)."""
        body = wire.LeaseUpdate(lease_id=lease_id, bytes=nbytes, expected_end_s=expected_end_s)
        try:
            status, content = await self._post(wire.LEASE_PATH, wire.encode(body))
            return status == 200 and wire.decode_lease(content).updated
        except (asyncio.TimeoutError, aiohttp.ClientError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return False

    async def place(self, req: wire.PlaceRequest) -> wire.PlaceAnswer | str:
        """P, D and the lane at once, or why not: ``timeout`` and ``unreachable`` (the
        service may have placed and reserved: its lease ends it), ``http_<status>`` and
        ``bad_answer``."""
        try:
            status, content = await self._post(wire.PLACE_PATH, wire.encode(req))
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientError:
            return "unreachable"
        if status != 200:
            return f"http_{status}"
        try:
            return wire.decode_place(content)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return "bad_answer"

    async def close(self) -> None:
        """Send the releases still queued, then close the connections."""
        if self._flusher is not None and not self._flusher.done():
            try:
                await asyncio.wait_for(self._flusher, RELEASE_BATCH_S + 2 * self.timeout.total)
            except asyncio.TimeoutError:
                pass
        if self._session is not None:
            await self._session.close()
