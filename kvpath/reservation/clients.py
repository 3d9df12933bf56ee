"""How the proxy asks for a lane: in-process service or HTTP, with a short timeout.

Both are :class:`~kvpath.reservation.wire.AsyncReserver`. A reservation that does
not come back in time (service down, slow, no lanes known) is a *fallback*: the P
connector then takes the hash-chosen lane, and the reason is counted. Requests
never wait long on the reservation service.
"""

from __future__ import annotations

from typing import Sequence

import httpx
import msgspec

from kvpath.reservation import wire
from kvpath.placement import CostModel, PlacementError
from kvpath.reservation.decisions import ReservationError, ReservationService, SyncReserver
from kvpath.reservation.placer import place_request
from kvpath.reservation.wire import FlowScope, LaneGrant, LaneInfo

_JSON = {"content-type": "application/json"}


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
    ``transport``: httpx's, for tests."""

    def __init__(self, url: str, timeout_s: float = 0.05, token: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=64), headers=headers,
                                        transport=transport)

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                      transfer_id: str = "", scope: FlowScope | None = None) -> LaneGrant:
        req = wire.ReserveRequest(src_host=src_host, dst_host=dst_host, bytes=nbytes,
                                  lanes=list(lanes) if lanes else None, transfer_id=transfer_id, scope=scope)
        try:
            r = await self.client.post(self.url + wire.RESERVE_PATH, content=wire.encode(req), headers=_JSON)
        except httpx.TimeoutException:
            return LaneGrant(fallback="timeout")
        except httpx.HTTPError:
            return LaneGrant(fallback="unreachable")
        if r.status_code != 200:
            return LaneGrant(fallback=f"http_{r.status_code}")
        try:
            return LaneGrant.of(wire.decode_answer(r.content))
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # (ValidationError included)
            return LaneGrant(fallback="bad_answer")

    async def release(self, lease_id: str) -> None:
        try:
            await self.client.post(self.url + wire.RELEASE_PATH, content=wire.encode(wire.ReleaseRequest(lease_id)),
                                   headers=_JSON)
        except httpx.HTTPError:
            pass  # the lease ends it anyway

    async def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> bool:
        """True when the service updated the live lease; False for every fault (best effort:
        the reservation keeps its first bytes and its lease)."""
        body = wire.LeaseUpdate(lease_id=lease_id, bytes=nbytes, expected_end_s=expected_end_s)
        try:
            r = await self.client.post(self.url + wire.LEASE_PATH, content=wire.encode(body), headers=_JSON)
            return r.status_code == 200 and wire.decode_lease(r.content).updated
        except (httpx.HTTPError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return False

    async def place(self, req: wire.PlaceRequest) -> wire.PlaceAnswer | str:
        """P, D and the lane at once, or why not: ``timeout`` and ``unreachable`` (the
        service may have placed and reserved: its lease ends it), ``http_<status>`` and
        ``bad_answer``."""
        try:
            r = await self.client.post(self.url + wire.PLACE_PATH, content=wire.encode(req), headers=_JSON)
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:
            return "unreachable"
        if r.status_code != 200:
            return f"http_{r.status_code}"
        try:
            return wire.decode_place(r.content)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return "bad_answer"

    async def close(self) -> None:
        await self.client.aclose()
