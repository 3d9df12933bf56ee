"""``kvpath proxy``'s HTTP side (FastAPI): the routes, admin included, and an ASGI fast
path for the two inference endpoints. What a request does is proxy/core.py's
:class:`Proxy`; its configuration is proxy/config.py, the bodies it validates
proxy/bodies.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpath.proxy.bodies import INFERENCE, ChatBody, CompletionBody, InstanceBody
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance, PoolFull
from kvpath.proxy.upstream import engine_error, exc_text
from kvpath.reservation.app import MAX_BODY_BYTES as RESERVATION_MAX_BODY_BYTES
from kvpath.web.body_limit import BodyLimit
from kvpath.web.errors import describe_validation_errors, error_response, is_invalid_json

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


class _InferenceFastPath:
    """ASGI front for the two inference endpoints; everything else goes to FastAPI.

    Per request and per relayed chunk, FastAPI's routing and Starlette's middleware
    wrappers cost about a fifth of the proxy's CPU; the inference calls need none of
    them (``Proxy.handle`` does its own parsing, validation and error answers)."""

    def __init__(self, app: FastAPI, proxy: Proxy):
        self.app, self.proxy = app, proxy
        # every route: the inference calls up to max_body_bytes, the mounted reservation
        # service 1 MiB, the rest (admin, health, metrics) 64 KiB, all before any token check
        self._limited = BodyLimit(self._route, proxy.cfg.max_body_bytes, _route_limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._limited(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        schema = INFERENCE.get(scope.get("path", "")) if scope["type"] == "http" else None
        if schema is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            response = await self.proxy.handle(Request(scope, receive, send), scope["path"], schema)
        except Exception:
            logger.exception("%s failed inside the proxy", scope["path"])
            response = error_response(500, "internal proxy error (see the proxy's log)")
        await response(scope, receive, send)


def _route_limit(scope: Scope) -> int:
    path = scope.get("path", "")
    if path in INFERENCE:
        return 1 << 62  # max_body_bytes decides
    return RESERVATION_MAX_BODY_BYTES if path.startswith("/reservation/") else 64 * 1024


def create_app(proxy: Proxy, reservation_app: FastAPI | None = None) -> ASGIApp:
    """The proxy's HTTP app. ``reservation_app`` (the in-process reservation
    service's API) is mounted at ``/reservation``, so P connectors can register
    their lanes with ``reservation_url=http://<proxy>/reservation``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.stop()

    app = FastAPI(title="kvpath P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy

    # POSTs to these two never get here (_InferenceFastPath answers them); the
    # routes stay so that /docs lists them and other methods get 405, not 404.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions", CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions", ChatBody)

    @app.get("/v1/models")
    async def models() -> Response:
        ds = proxy.pools["decode"].all()
        if not ds:
            return error_response(503, "no decode instance is configured")
        d = next((i for i in ds if i.healthy), ds[0])
        session = proxy.engines.session
        assert session is not None
        try:
            async with session.get(d.url + "/v1/models", headers=proxy.engine_headers,
                                   timeout=proxy.engines.answer_timeout) as r:
                if r.status in (401, 403):  # the proxy's engine key, not the client's
                    return error_response(502, engine_error(d, r.status, await r.text(), r.headers).message)
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(502, f"decode {d.url} unreachable: {exc_text(e)}")

    @app.get("/health")
    async def health() -> Response:
        ok = bool(proxy.pools["prefill"].all() and proxy.pools["decode"].all())
        return JSONResponse({"status": "ok" if ok else "no instances"}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status(request: Request) -> Response:
        # engine URLs and addresses only with the admin token; without one, counts and
        # health by role and position; a token that is wrong is told so (not answered
        # with the short view, which would hide a misconfigured dashboard)
        if request.headers.get("authorization") is not None and not proxy.authorized(request):
            return error_response(401, "admin token required for the full status (without an Authorization "
                                       "header: the view without engine addresses)")
        return JSONResponse(proxy.status(full=proxy.authorized(request)))

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.refresh_gauges()
        return Response(proxy.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> Response:
        if not proxy.authorized(request):
            return error_response(401 if proxy.cfg.admin_token else 403, "admin token required" if proxy.cfg.admin_token
                                  else "admin endpoints are disabled (give the proxy an admin token: --admin-token-file or KVPATH_ADMIN_TOKEN)")
        try:
            b = InstanceBody.model_validate_json(await request.body())
        except ValidationError as e:
            msg, fields = describe_validation_errors(e.errors())
            return error_response(400 if is_invalid_json(e.errors()) else 422, msg, fields=fields)
        if b.role == "prefill" and proxy.cfg.mode != "pull" and not b.kv_addr:
            return error_response(
                422, f"kv_addr: a prefill instance needs its KV side channel host:port in {proxy.cfg.mode} mode",
                fields=["kv_addr"])
        inst = Instance(b.url.rstrip("/"), b.role, b.fabric_host, b.kv_addr, b.engine_id, tp_size=b.tp_size)
        try:
            new = proxy.change_instances(lambda: proxy.pools[b.role].add(inst))
        except PoolFull as e:
            return error_response(409, str(e))
        return JSONResponse({"added" if new else "updated": b.url, "role": b.role}, status_code=201 if new else 200)

    @app.delete("/admin/instances")
    async def remove_instance(request: Request, role: str, url: str) -> Response:
        if not proxy.authorized(request):
            return error_response(401 if proxy.cfg.admin_token else 403, "admin token required")
        if role not in proxy.pools:
            return error_response(422, "role must be prefill or decode", fields=["role"])
        if not proxy.change_instances(lambda: proxy.pools[role].remove(url.rstrip("/"))):
            return error_response(404, f"no {role} instance {url}")
        return JSONResponse({"removed": url, "role": role})

    if reservation_app is not None:
        app.mount("/reservation", reservation_app)  # its leases expire lazily: mounts get no lifespan
    return _InferenceFastPath(app, proxy)
