"""``kvpath reservation``: the reservation service over HTTP (FastAPI).

POST /v1/reserve   {src_host, dst_host, bytes, lanes?, transfer_id?, scope?} -> lane, path, lease
POST /v1/release   {lease_id} -> {released}   (idempotent)
POST /v1/lease     {lease_id, bytes, expected_end_s?} -> {updated, bytes, expires_in_s}
                   (a live reservation's flow, better known: its bytes, when it expects to end)
POST /v1/place     {prefill: [...], decode: [...], prompt_tokens, bytes, transfer_id?, policy?, guard?}
                   -> prefill, decode, lane, lease, predicted (P, D and the lane at once: docs/placement.md)
POST /v1/lanes     {src_host, dst_host, pair?, worker?, lanes} (P connectors register the lanes
                   they opened: per (P worker, D worker) pair, each lane's full 5-tuple)
POST /v1/lanes/unregister {src_host, dst_host, pair?, worker?} (forget one pair's lanes)
GET  /v1/state, /v1/decisions?since=UNIX_S, /health, /metrics

The routes and bodies are kvpath.reservation.wire's (one definition for the service
and its clients).

Every route but /health and /metrics needs ``Authorization: Bearer <token>``: the
lane registry steers every later flow of a host pair (a forged registration, or a
removal, moves them); reserve and release skew the loads every decision sees and end
other clients' leases; the reads name P/D agents, live transfer ids and lease ids.
A service built without a token answers those routes 403 (``kvpath reservation`` and
``kvpath proxy --reservation inproc`` refuse to start without one). A reservation that
names its ``lanes`` may name only lanes registered for the pair (a 422 naming
``lanes`` otherwise): a caller narrows the candidates, it never makes lanes up.
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

from kvpath.reservation import wire
from kvpath.placement import CostModel, PlacementError
from kvpath.reservation.decisions import ReservationError, ReservationService, UnregisteredLanes
from kvpath.reservation.placer import place_request
from kvpath.web.auth import bearer_ok
from kvpath.web.body_limit import BodyLimit
from kvpath.web.errors import describe_msgspec_error, describe_validation_errors, is_invalid_json

logger = logging.getLogger(__name__)

# The largest body any call needs: a lane registration of a few thousand lanes.
MAX_BODY_BYTES = 1024 * 1024

_BODIES = (wire.ReserveRequest, wire.ReleaseRequest, wire.ReleasesRequest, wire.LeaseUpdate, wire.PlaceRequest, wire.LanesRequest,
           wire.LanesRemoval)
Body = TypeVar("Body", wire.ReserveRequest, wire.ReleaseRequest, wire.ReleasesRequest, wire.LeaseUpdate, wire.PlaceRequest,
               wire.LanesRequest, wire.LanesRemoval)
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


def create_app(svc: ReservationService, expire_every_s: float = 0.5, token: str | None = None,
               cost: CostModel | None = None) -> FastAPI:
    """``token``: what every call but /health and /metrics needs (see above); without
    one those calls answer 403. ``cost``: the placement's cost model (None: /v1/place
    answers 501)."""
    reg = CollectorRegistry()
    m_dec = Counter("kvpath_reservations_total", "reservation decisions", ["mode", "outcome"], registry=reg)
    m_rel = Counter("kvpath_releases_total", "releases", ["known"], registry=reg)
    m_place = Counter("kvpath_placements_total", "joint placements (P, D and lane)", ["policy", "outcome"],
                      registry=reg)
    m_place_lat = Histogram("kvpath_place_seconds", "time to decide one placement", registry=reg,
                            buckets=[1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05])
    m_upd = Counter("kvpath_lease_updates_total", "lease updates (known: the lease was live)", ["known"], registry=reg)
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

    def check_token(request: Request) -> None:
        if not token:
            raise HTTPException(403, "the reservation service's API is disabled: it was started without a token "
                                     f"(--token-file PATH or {wire.TOKEN_ENV})")
        if not bearer_ok(request.headers.get("authorization"), token):
            raise HTTPException(401, "token required (Authorization: Bearer TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})

    async def authorized_body(request: Request, kind: type[Body]) -> Body:
        """The body as ``kind``, after the token: a body that is not JSON at all is a
        400 even before it, any other fault of the body (422) only after it."""
        raw = await request.body()
        if not (token and bearer_ok(request.headers.get("authorization"), token)):
            if raw.strip():  # an empty body is the fields' error (422), after the token
                parse_json(raw)
            check_token(request)  # raises
        return parse_body(raw, kind)  # one decode on the way every client with the token takes

    # Handlers are async on purpose: the event loop serializes them, so the
    # in-process service needs no lock. Bodies are the wire's types (msgspec).
    @app.post(wire.RESERVE_PATH)
    async def reserve(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.ReserveRequest)
        except BadBody as e:
            return e.response
        t0 = time.perf_counter()
        try:
            if body.lanes:  # only lanes P registered: a made-up lane would steer the flow off P's paths
                svc.check_registered(body.src_host, body.dst_host, body.lanes, body.scope)
            r = svc.reserve(body.src_host, body.dst_host, body.bytes, body.lanes, body.transfer_id, body.scope)
        except UnregisteredLanes as e:
            m_dec.labels(svc.mode, "rejected").inc()
            return BadBody(422, str(e), ["lanes"]).response
        except ReservationError as e:
            m_dec.labels(svc.mode, "rejected").inc()
            raise HTTPException(422, str(e)) from None
        m_lat.observe(time.perf_counter() - t0)
        m_dec.labels(svc.mode, r.fallback or "decided").inc()
        return _json(r.answer(svc.clock()))

    @app.post(wire.RELEASE_PATH)
    async def release(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.ReleaseRequest)
        except BadBody as e:
            return e.response
        ok = svc.release(body.lease_id)
        m_rel.labels(str(ok).lower()).inc()
        return _json(wire.ReleaseAnswer(body.lease_id, ok))

    @app.post(wire.RELEASES_PATH)
    async def releases(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.ReleasesRequest)
        except BadBody as e:
            return e.response
        done = sum(svc.release(lid) for lid in body.lease_ids)
        m_rel.labels("true").inc(done)
        m_rel.labels("false").inc(len(body.lease_ids) - done)
        return _json(wire.ReleasesAnswer(done, len(body.lease_ids) - done))

    @app.post(wire.LEASE_PATH)
    async def lease(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.LeaseUpdate)
        except BadBody as e:
            return e.response
        try:
            r = svc.update(body.lease_id, body.bytes, body.expected_end_s)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        m_upd.labels(str(r is not None).lower()).inc()
        if r is None:
            return _json(wire.LeaseAnswer(lease_id=body.lease_id))
        return _json(wire.LeaseAnswer(lease_id=r.lease_id, updated=True, bytes=r.bytes,
                                      expires_in_s=r.expires_in(svc.clock())))

    @app.post(wire.PLACE_PATH)
    async def place_route(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.PlaceRequest)
        except BadBody as e:
            return e.response
        if cost is None:
            raise HTTPException(501, "placement is not configured on this service (docs/placement.md)")
        t0 = time.perf_counter()
        try:
            pl = place_request(svc, cost, body)
        except (PlacementError, ReservationError) as e:
            m_place.labels(body.policy, "rejected").inc()
            raise HTTPException(422, str(e)) from None
        m_place_lat.observe(time.perf_counter() - t0)
        m_place.labels(body.policy, pl.fallback or "decided").inc()
        return _json(pl)

    @app.post(wire.LANES_PATH)
    async def lanes(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.LanesRequest)
        except BadBody as e:
            return e.response
        try:
            svc.register_lanes(body.src_host, body.dst_host, body.lanes, body.worker, body.pair)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        return _json(wire.LanesAnswer(True, len(body.lanes)))

    @app.post(wire.UNREGISTER_PATH)
    async def unregister(request: Request) -> Response:
        try:
            body = await authorized_body(request, wire.LanesRemoval)
        except BadBody as e:
            return e.response
        try:
            n = svc.unregister_lanes(body.src_host, body.dst_host, body.worker, body.pair)
        except ReservationError as e:
            raise HTTPException(422, str(e)) from None
        return _json(wire.LanesAnswer(n > 0, n))

    # The reads name P/D agents, live transfer ids and lease ids: behind the token.
    @app.get(wire.STATE_PATH)
    async def state(request: Request) -> dict:
        check_token(request)
        return svc.state()

    @app.get(wire.DECISIONS_PATH)
    async def decisions(request: Request, since: float = 0.0) -> Response:
        """The service's last decisions (up to 100,000) made after ``since`` (unix s), its
        lane registry's changes (all it keeps: the registry before its window as one
        registration per pair, then the window; ``lanes_complete_from_seq``: from which
        sequence number on they rebuild the registry) and the placement's cost model:
        what replays every decision and placement (kvpath/reservation/replay.py).
        Encoded by msgspec: a full log is tens of megabytes, and FastAPI's own encoder
        would hold the event loop (every reservation) for seconds."""
        check_token(request)
        return Response(msgspec.json.encode({
            "decisions": [d for d in svc.decisions if d["at"] > since], "lanes": svc.lane_log.events(),
            "lanes_complete_from_seq": svc.lane_log.complete_from_seq,
            "cost_model": cost.to_dict() if cost is not None else None}), media_type="application/json")

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
