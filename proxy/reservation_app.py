"""``kvpath reservation``: the reservation service over HTTP (FastAPI).

POST /v1/reserve   {src_host, dst_host, bytes, lanes?, transfer_id?} -> lane, path, lease
POST /v1/release   {lease_id} -> {released}   (idempotent)
POST /v1/lanes     {src_host, dst_host, worker?, lanes} (P connectors register the lanes they
                   opened: per (P worker, D worker) pair, each lane's full 5-tuple)
GET  /v1/state, /health, /metrics

With an admin token, POST /v1/lanes needs ``Authorization: Bearer <token>``: a
forged registration would steer every later flow of that host pair (or point it at
lanes P does not have). /v1/reserve and /v1/release stay open: the proxy and P
connectors call them per request, and what a stranger could do with them (add load
records, end others') only skews the loads decisions see until leases or pushes end.
Reads stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field

from kvpath.proxy.auth import bearer_ok
from kvpath.proxy.errors import describe_validation_errors, is_invalid_json
from kvpath.reservation import LaneInfo, ReservationError, ReservationService

logger = logging.getLogger(__name__)


class LaneModel(BaseModel):
    lane: int = Field(ge=0, le=1023)
    src_port: int = Field(ge=0, le=65535)
    dst_port: int = Field(default=0, ge=0, le=65535)
    src_ip: str = Field(default="", max_length=64)
    dst_ip: str = Field(default="", max_length=64)
    proto: str = Field(default="tcp", pattern="^(tcp|udp)$")

    def info(self) -> LaneInfo:
        return LaneInfo(self.lane, self.src_port, self.dst_port, self.src_ip, self.dst_ip, self.proto)


class ReserveBody(BaseModel):
    src_host: str = Field(min_length=1, max_length=64)
    dst_host: str = Field(min_length=1, max_length=64)
    bytes: int = Field(ge=0)
    lanes: list[LaneModel] | None = Field(default=None, max_length=1024)
    transfer_id: str = Field(default="", max_length=256)


class ReleaseBody(BaseModel):
    lease_id: str = Field(min_length=1, max_length=64)


class LanesBody(BaseModel):
    src_host: str = Field(min_length=1, max_length=64)
    dst_host: str = Field(min_length=1, max_length=64)
    # which (P worker, D worker) pair these lanes belong to; pairs never overwrite each other
    worker: str = Field(default="", max_length=512)
    lanes: list[LaneModel] = Field(min_length=1, max_length=1024)


def validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming the field; a body that is not JSON at all is a 400."""
    errs = exc.errors()
    if is_invalid_json(errs):
        return JSONResponse({"error": "invalid JSON body"}, status_code=400)
    msg, fields = describe_validation_errors(errs)
    return JSONResponse({"error": msg, "fields": fields}, status_code=422)


def create_app(svc: ReservationService, expire_every_s: float = 0.5, admin_token: str | None = None) -> FastAPI:
    """``admin_token``: required by the calls that change the lane registry (see above)."""
    reg = CollectorRegistry()
    m_dec = Counter("kvpath_reservations_total", "reservation decisions", ["mode", "outcome"], registry=reg)
    m_rel = Counter("kvpath_releases_total", "releases", ["known"], registry=reg)
    m_lat = Histogram("kvpath_reserve_seconds", "time to decide one reservation", registry=reg,
                      buckets=[1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.02])
    m_active = Gauge("kvpath_active_leases", "reservations holding load", registry=reg)
    m_expired = Gauge("kvpath_leases_expired", "leases that ended without a release (cumulative)", registry=reg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def expirer():
            while True:
                await asyncio.sleep(expire_every_s)
                svc.expire()

        task = asyncio.create_task(expirer())
        yield
        task.cancel()

    app = FastAPI(title="kvpath reservation service", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.state.svc = svc

    def admin(request: Request) -> None:
        if admin_token and not bearer_ok(request.headers.get("authorization"), admin_token):
            raise HTTPException(401, "admin token required (Authorization: Bearer TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})

    # Handlers are async on purpose: the event loop serializes them, so the
    # in-process service needs no lock.
    @app.post("/v1/reserve")
    async def reserve(body: ReserveBody) -> dict:
        t0 = time.perf_counter()
        lanes = [x.info() for x in body.lanes] if body.lanes else None
        try:
            r = svc.reserve(body.src_host, body.dst_host, body.bytes, lanes, body.transfer_id)
        except ReservationError as e:
            m_dec.labels(svc.mode, "rejected").inc()
            raise HTTPException(422, str(e)) from None
        m_lat.observe(time.perf_counter() - t0)
        m_dec.labels(svc.mode, r.fallback or "decided").inc()
        return r.to_dict(svc.clock())

    @app.post("/v1/release")
    async def release(body: ReleaseBody) -> dict:
        ok = svc.release(body.lease_id)
        m_rel.labels(str(ok).lower()).inc()
        return {"lease_id": body.lease_id, "released": ok}

    @app.post("/v1/lanes", dependencies=[Depends(admin)])
    async def lanes(body: LanesBody) -> dict:
        try:
            svc.register_lanes(body.src_host, body.dst_host, [x.info() for x in body.lanes], body.worker)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        return {"ok": True, "lanes": len(body.lanes)}

    @app.get("/v1/state")
    async def state() -> dict:
        return svc.state()

    @app.get("/v1/decisions")
    async def decisions(since: float = 0.0) -> dict:
        """The service's last decisions (up to 100,000), those made after ``since`` (unix s)."""
        return {"decisions": [d for d in svc.decisions if d["at"] > since]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "mode": svc.mode}

    @app.get("/metrics")
    async def metrics() -> Response:
        svc.expire()
        m_active.set(len(svc.active))
        m_expired.set(svc.counters.get("leases_expired", 0))
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
