"""How the proxy asks for a lane: in-process service or HTTP, with a short timeout.

A reservation that does not come back in time (service down, slow, no lanes
known) is a *fallback*: the P connector then takes the hash-chosen lane, and the
reason is counted. Requests never wait long on the reservation service.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from kvpath.reservation import ReservationError, ReservationService


@dataclass
class LaneGrant:
    lane: int | None
    lease_id: str | None
    spine: str | None
    fallback: str = ""  # "" when the service decided; else why not


class InProcessReserver:
    def __init__(self, svc: ReservationService):
        self.svc = svc

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, transfer_id: str) -> LaneGrant:
        try:
            r = self.svc.reserve(src_host, dst_host, nbytes, None, transfer_id)
        except ReservationError as e:
            return LaneGrant(None, None, None, f"rejected: {e}")
        if r.fallback:
            return LaneGrant(None, None, None, r.fallback)
        return LaneGrant(r.lane, r.lease_id, r.path.spine if r.path else None)

    async def release(self, lease_id: str) -> None:
        self.svc.release(lease_id)

    async def close(self) -> None:
        return None


class HttpReserver:
    def __init__(self, url: str, timeout_s: float = 0.05):
        self.url = url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=64))

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, transfer_id: str) -> LaneGrant:
        try:
            r = await self.client.post(f"{self.url}/v1/reserve", json={
                "src_host": src_host, "dst_host": dst_host, "bytes": nbytes, "transfer_id": transfer_id})
        except httpx.TimeoutException:
            return LaneGrant(None, None, None, "timeout")
        except httpx.HTTPError:
            return LaneGrant(None, None, None, "unreachable")
        if r.status_code != 200:
            return LaneGrant(None, None, None, f"http_{r.status_code}")
        d = r.json()
        if d.get("fallback"):
            return LaneGrant(None, None, None, d["fallback"])
        return LaneGrant(d.get("lane"), d.get("lease_id"), d.get("spine"))

    async def release(self, lease_id: str) -> None:
        try:
            await self.client.post(f"{self.url}/v1/release", json={"lease_id": lease_id})
        except httpx.HTTPError:
            pass  # the lease ends it anyway

    async def close(self) -> None:
        await self.client.aclose()
