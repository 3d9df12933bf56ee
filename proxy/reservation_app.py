"""``kvpath reservation``: the reservation service over HTTP (FastAPI).

POST /v1/reserve   {src_host, dst_host, bytes, lanes?, transfer_id?} -> lane, path, lease
POST /v1/release   {lease_id} -> {released}   (idempotent)
POST /v1/lanes     {src_host, dst_host, pair?, worker?, lanes} (P connectors register the lanes
                   they opened: per (P worker, D worker) pair, each lane's full 5-tuple)
POST /v1/lanes/unregister {src_host, dst_host, pair?, worker?} (forget one pair's lanes)
GET  /v1/state, /v1/decisions?since=UNIX_S, /health, /metrics

The routes and bodies are kvpath.reservation_wire's (one definition for the service
and its clients).

With an admin token, POST /v1/lanes and /v1/lanes/unregister need ``Authorization:
Bearer <token>``: a forged registration would steer every later flow of that host pair
(or point it at lanes P does not have). /v1/reserve and /v1/release stay open: the
proxy and P connectors call them per request, and what a stranger could do with them
(add load records, end others') only skews the loads decisions see until leases or
pushes end. The reads GET /v1/state and /v1/decisions name P/D agents and live
transfer ids, so they need the token too; /health and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TypeVar

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpath import reservation_wire as wire
from kvpath.proxy.auth import bearer_ok
from kvpath.proxy.body_limit import BodyLimit
from kvpath.proxy.errors import describe_msgspec_error, describe_validation_errors, is_invalid_json
from kvpath.reservation import ReservationError, ReservationService

logger = logging.getLogger(__name__)

# The largest body any call needs: a lane registration of a few thousand lanes.
MAX_BODY_BYTES = 1024 * 1024

_BODIES = (wire.ReserveRequest, wire.ReleaseRequest, wire.LanesRequest, wire.LanesRemoval)
Body = TypeVar("Body", wire.ReserveRequest, wire.ReleaseRequest, wire.LanesRequest, wire.LanesRemoval)
# strict=False: numbers written as strings ("5") are read as numbers, as the service always did
_DECODERS = {t: msgspec.json.Decoder(t, strict=False) for t in _BODIES}


class BadBody(Exception):
    """A request body that is not JSON (400) or not of the wire's type (422)."""

    def __init__(self, status: int, message: str, fields: list[str] | None = None):
        super().__init__(message)
        self.response = JSONResponse({"error": message, **({"fields": fields} if fields is not None else {})},
                                     status_code=status)


# msgspec raises more than DecodeError on hostile bytes: bad UTF-8, and nesting deep
# enough to exhaust the recursion limit (even inside a field it would ignore).
_NOT_JSON = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def parse_json(raw: bytes) -> object:
    """Any JSON value; :class:`BadBody` (400) when ``raw`` is not JSON at all."""
    try:
        return msgspec.json.decode(raw)
    except _NOT_JSON:
        raise BadBody(400, "invalid JSON body") from None


def parse_body(raw: bytes, kind: type[Body]) -> Body:
    """``raw`` decoded as the wire's ``kind``; :class:`BadBody` otherwise (an empty
    body, like a missing field, is a 422 naming it)."""
    if not raw.strip():
        raise BadBody(422, "body: Field required", ["body"])
    try:
        return _DECODERS[kind].decode(raw)
    except msgspec.ValidationError as e:
        msg, fields = describe_msgspec_error(e)
        raise BadBody(422, msg, fields) from None
    except _NOT_JSON:
        raise BadBody(400, "invalid JSON body") from None


def _json(body: msgspec.Struct) -> Response:
    return Response(wire.encode(body), media_type="application/json")


def validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    """The query parameters' errors (FastAPI validates those): 422 naming the field."""
    errs = exc.errors()
    if is_invalid_json(errs):
        return JSONResponse({"error": "invalid JSON body"}, status_code=400)
    msg, fields = describe_validation_errors(errs)
    return JSONResponse({"error": msg, "fields": fields}, status_code=422)


def create_app(svc: ReservationService, expire_every_s: float = 0.5, admin_token: str | None = None) -> FastAPI:
    """``admin_token``: required by the calls that change the lane registry and by the
    reads of state and decisions (see above)."""
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
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.state.svc = svc

    def check_admin(request: Request) -> None:
        if admin_token and not bearer_ok(request.headers.get("authorization"), admin_token):
            raise HTTPException(401, "admin token required (Authorization: Bearer TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})

    # Handlers are async on purpose: the event loop serializes them, so the
    # in-process service needs no lock. Bodies are the wire's types (msgspec).
    @app.post(wire.RESERVE_PATH)
    async def reserve(request: Request) -> Response:
        try:
            body = parse_body(await request.body(), wire.ReserveRequest)
        except BadBody as e:
            return e.response
        t0 = time.perf_counter()
        try:
            r = svc.reserve(body.src_host, body.dst_host, body.bytes, body.lanes, body.transfer_id, body.scope)
        except ReservationError as e:
            m_dec.labels(svc.mode, "rejected").inc()
            raise HTTPException(422, str(e)) from None
        m_lat.observe(time.perf_counter() - t0)
        m_dec.labels(svc.mode, r.fallback or "decided").inc()
        return _json(r.answer(svc.clock()))

    @app.post(wire.RELEASE_PATH)
    async def release(request: Request) -> Response:
        try:
            body = parse_body(await request.body(), wire.ReleaseRequest)
        except BadBody as e:
            return e.response
        ok = svc.release(body.lease_id)
        m_rel.labels(str(ok).lower()).inc()
        return _json(wire.ReleaseAnswer(body.lease_id, ok))

    @app.post(wire.LANES_PATH)
    async def lanes(request: Request) -> Response:
        raw = await request.body()
        try:
            if raw.strip():  # an empty body is the fields' error (422), after the token
                parse_json(raw)  # a body that is not JSON at all is a 400 even before the token
            check_admin(request)  # then the token, before the body's fields are looked at
            body = parse_body(raw, wire.LanesRequest)
        except BadBody as e:
            return e.response
        try:
            svc.register_lanes(body.src_host, body.dst_host, body.lanes, body.worker, body.pair)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        return _json(wire.LanesAnswer(True, len(body.lanes)))

    @app.post(wire.UNREGISTER_PATH)
    async def unregister(request: Request) -> Response:
        raw = await request.body()
        try:
            if raw.strip():
                parse_json(raw)
            check_admin(request)
            body = parse_body(raw, wire.LanesRemoval)
        except BadBody as e:
            return e.response
        try:
            n = svc.unregister_lanes(body.src_host, body.dst_host, body.worker, body.pair)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        return _json(wire.LanesAnswer(n > 0, n))

    # The reads name P/D agents and live transfer ids: behind the token when there is one.
    @app.get(wire.STATE_PATH)
    async def state(request: Request) -> dict:
        check_admin(request)
        return svc.state()

    @app.get(wire.DECISIONS_PATH)
    async def decisions(request: Request, since: float = 0.0) -> dict:
        """The service's last decisions (up to 100,000), those made after ``since`` (unix s)."""
        check_admin(request)
        return {"decisions": [d for d in svc.decisions if d["at"] > since]}

    @app.get(wire.HEALTH_PATH)
    async def health() -> dict:
        return {"status": "ok", "mode": svc.mode}

    @app.get(wire.METRICS_PATH)
    async def metrics() -> Response:
        svc.expire()
        m_active.set(len(svc.active))
        m_expired.set(svc.counters.get("leases_expired", 0))
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
