"""``kvpath proxy``: the OpenAI-compatible P/D proxy (FastAPI; aiohttp upstream).

For each request it picks a P and a D instance, asks for a lane (push mode),
runs the two legs and passes D's response through unchanged (streamed or not).
The upstream legs use aiohttp: httpx's connection pool scans every connection for
every queued request, which made the proxy CPU-bound at 64 concurrent streams.

Each leg is bounded by the time to its first byte, D's stream by the gap between
its chunks (never by its length); a stream that fails after it started ends with
an error event (proxy/stream_guard.py). Instances failing health checks leave
rotation (proxy/health.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpath.proxy import legs
from kvpath.proxy.auth import bearer_ok
from kvpath.proxy.errors import describe_validation_errors, is_invalid_json
from kvpath.proxy.health import HealthChecker
from kvpath.proxy.instances import POLICIES, Instance, InstancePool, NoInstance
from kvpath.proxy.metrics import ProxyMetrics
from kvpath.proxy.relay import RelayResponse, wait_for_disconnect
from kvpath.proxy.reservation_client import LaneGrant
from kvpath.proxy.stream_guard import ChunkGapTimeout, EventFramer, GapWatch, error_event
from kvpath.proxy.upstream import UpstreamError, engine_error, first_byte_timeout, is_transport_failure, transport_error

logger = logging.getLogger(__name__)


@dataclass
class ProxyConfig:
    mode: str = "push"
    policy: str = "round_robin"
    admin_token: str | None = None
    # Time to a leg's first byte (a non-streamed answer comes whole, so all of it);
    # never the length of a stream, which only the gap between chunks bounds.
    first_byte_timeout_s: float = 300.0
    chunk_gap_timeout_s: float = 60.0
    # TCP connect only (not time queued for a pooled connection). Generous: on a
    # saturated machine the proxy's own event loop can be seconds late to see it.
    connect_timeout_s: float = 15.0
    health_interval_s: float = 2.0  # 0: no health checks
    # Generous for the same reason as connect_timeout_s: a late loop must not
    # take healthy engines out of rotation.
    health_timeout_s: float = 5.0
    unhealthy_after: int = 2
    kv_bytes_per_token: int = 131072  # for the reservation's flow size estimate
    max_connections: int = 2048

    def validate(self) -> None:
        if self.mode not in legs.MODES:
            raise ValueError(f"mode must be one of {legs.MODES}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if min(self.first_byte_timeout_s, self.chunk_gap_timeout_s, self.connect_timeout_s, self.health_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.health_interval_s < 0 or self.unhealthy_after < 1:
            raise ValueError("health_interval_s must be >= 0 and unhealthy_after >= 1")


class ClientGone(Exception):
    """The client closed its connection before the answer started."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionBody(_Strict):
    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    stream: bool = Field(default=False, strict=True)


class ChatBody(_Strict):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    stream: bool = Field(default=False, strict=True)


class InstanceBody(BaseModel):
    role: str = Field(pattern="^(prefill|decode)$")
    url: str = Field(min_length=8, pattern="^https?://")
    fabric_host: str = ""
    kv_addr: str = ""
    engine_id: str = ""


def _error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status, **extra}}, status_code=status, headers=headers)


class Proxy:
    def __init__(self, cfg: ProxyConfig, prefill: list[Instance], decode: list[Instance], reserver: Any = None):
        cfg.validate()
        self.cfg = cfg
        self.pools = {"prefill": InstancePool("prefill", cfg.policy), "decode": InstancePool("decode", cfg.policy)}
        for i in prefill + decode:
            self.pools[i.role].add(i)
        self.reserver = reserver
        self.metrics = ProxyMetrics()
        for role, pool in self.pools.items():
            self.metrics.healthy.labels(role).set_function(pool.healthy_count)
        self.health = HealthChecker(self.pools, cfg.health_interval_s, cfg.health_timeout_s, cfg.unhealthy_after)
        self.session: aiohttp.ClientSession | None = None
        # whole non-streamed answers (P's leg, D's when not streaming, /v1/models)
        self.answer_timeout = aiohttp.ClientTimeout(total=cfg.first_byte_timeout_s, sock_connect=cfg.connect_timeout_s)
        self._background: set[asyncio.Task] = set()

    # ---- life cycle ------------------------------------------------------
    async def start(self) -> None:
        # no total: a stream may last as long as it keeps sending (GapWatch bounds its gaps)
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0),
            auto_decompress=False,
        )
        self.health.start(self.session)

    async def stop(self) -> None:
        await self.health.stop()
        for t in list(self._background):
            t.cancel()
        if self.session:
            await self.session.close()
        if self.reserver is not None:
            await self.reserver.close()

    # ---- request handling --------------------------------------------------
    async def handle(self, request: Request, endpoint: str, schema: type[BaseModel]) -> Response:
        t0 = time.perf_counter()
        try:
            raw = await request.body()
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._count(endpoint, _error(400, "request body is not valid JSON"), "bad_json")
        if not isinstance(body, dict):
            return self._count(endpoint, _error(400, "request body must be a JSON object"), "bad_json")
        try:
            schema.model_validate(body)
        except ValidationError as e:
            msg, fields = describe_validation_errors(e.errors())
            return self._count(endpoint, _error(422, msg, fields=fields), "schema")
        refused = legs.unsupported_field(body, self.cfg.mode)
        if refused:
            return self._count(endpoint, _error(422, refused[1], fields=[refused[0]]), "unsupported")
        body.pop("kv_transfer_params", None)  # the proxy owns the transfer parameters
        try:
            p, d = self.pools["prefill"].pick(), self.pools["decode"].pick()
        except NoInstance as e:
            return self._count(endpoint, _error(503, str(e)), "no_instance")
        try:
            resp = await self._run(request, endpoint, body, p, d, t0)
        except UpstreamError as e:
            logger.warning("%s -> %d %s: %s", endpoint, e.status, e.kind, e.message)
            return self._count(endpoint, _error(e.status, e.message, e.headers), e.kind)
        except ClientGone:
            # nobody reads this answer; 499 (nginx's "client closed request") keeps the metrics honest
            return self._count(endpoint, _error(499, "client closed the request"), "client_disconnect")
        return resp

    def _count(self, endpoint: str, resp: Response, error_kind: str | None = None) -> Response:
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        if error_kind:
            self.metrics.errors.labels(error_kind).inc()
        return resp

    async def _run(self, request: Request, endpoint: str, body: dict, p: Instance, d: Instance, t0: float) -> Response:
        assert self.session is not None
        stream = bool(body.get("stream"))
        tid = uuid.uuid4().hex
        headers = {"X-Request-Id": tid}
        grant = LaneGrant(None, None, None, "")
        self._enter(p, d)
        p_task: asyncio.Task | None = None
        handed_over = ok = False
        try:
            if self.cfg.mode == "push":
                grant = await self._reserve(p, d, body, tid)
                p_body, d_body = legs.push_legs(body, p, tid, grant.lane, grant.lease_id)
            elif self.cfg.mode == "inproc-push":
                p_body, d_body = legs.inproc_push_legs(body, p, tid, endpoint)
            else:
                p_body, d_body = legs.pull_prefill_leg(body), None
            if d_body is None:  # pull: P first, then D with what P returned
                p_out = await self._watch(request, self._post_json(p.url + endpoint, p_body, headers, p))
                d_body = legs.decode_body(body, p_out.get("kv_transfer_params") or {})
            else:
                p_task = asyncio.create_task(self._post_json(p.url + endpoint, p_body, headers, p))
            d_resp, first = await self._watch(
                request, self._open_decode(d, endpoint, d_body, headers, stream), p_task,
                self.cfg.first_byte_timeout_s, lambda: self._leg_timed_out(d))
            ttfb = time.perf_counter() - t0
            self.metrics.first_token.observe(ttfb)
            if stream:
                handed_over = True
                async def never_relayed() -> None:
                    d_resp.close()
                    self.metrics.requests.labels(endpoint, "499").inc()
                    self.metrics.errors.labels("client_disconnect").inc()
                    await self._finish(p, d, p_task, grant, False)

                return RelayResponse(
                    self._relay(d_resp, first, p, d, p_task, grant, endpoint, t0),
                    status_code=d_resp.status, media_type=d_resp.headers.get("content-type", "text/event-stream"),
                    on_unstarted=never_relayed,
                )
            content = first  # non-streaming: _open_decode read the whole body
            d_resp.release()
            ok = True
            d.served += 1
            self.metrics.e2e.observe(time.perf_counter() - t0)
            return self._count(endpoint, Response(content, status_code=d_resp.status,
                                                  media_type=d_resp.headers.get("content-type", "application/json")))
        except asyncio.CancelledError:  # the server itself cancelled the handler
            self.metrics.errors.labels("client_disconnect").inc()
            raise
        finally:
            if not handed_over:
                await self._finish(p, d, p_task, grant, ok)

    async def _relay(self, d_resp: aiohttp.ClientResponse, first: bytes, p: Instance, d: Instance,
                     p_task: asyncio.Task | None, grant: LaneGrant, endpoint: str, t0: float) -> AsyncIterator[bytes]:
        status = str(d_resp.status)
        ok = False
        framer = EventFramer()
        watch = GapWatch(d_resp.content, self.cfg.chunk_gap_timeout_s, f"decode {d.url}")
        read = d_resp.content.readany
        try:
            out = framer.feed(first)
            if out:
                yield out
            while True:
                watch.reading()
                chunk = await read()
                watch.got_chunk()
                if not chunk:
                    break
                out = framer.feed(chunk)
                if out:
                    yield out
            out = framer.flush()
            if out:
                yield out
            ok = True
            d.served += 1
            self.metrics.e2e.observe(time.perf_counter() - t0)
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"
            self.metrics.errors.labels("client_disconnect").inc()
            raise
        except (aiohttp.ClientError, ChunkGapTimeout) as e:
            # the client has its 200 already: say it in the stream, as vLLM does
            code = 504 if isinstance(e, ChunkGapTimeout) else 502
            message = str(e) if code == 504 else f"decode {d.url} stream broke: {e!r}"
            status = str(code)
            self._leg_failed(d, e)
            self.metrics.errors.labels("upstream_stream_error").inc()
            logger.warning("%s -> stream error %d: %s", endpoint, code, message)
            yield error_event(message, code)
        finally:
            watch.cancel()
            self.metrics.requests.labels(endpoint, status).inc()
            if ok:
                d_resp.release()
            else:
                d_resp.close()  # drop the connection: the engine sees the client leave and aborts
            await self._finish(p, d, p_task, grant, ok)

    async def _watch(self, request: Request, coro, p_task: asyncio.Task | None = None,
                     timeout_s: float | None = None, on_timeout: Callable[[], BaseException] | None = None):
        """Await ``coro`` (the D leg, or P in pull mode) while watching P's leg and the
        client: a failed P leg or a gone client cancels it, and so does ``timeout_s``
        passing (then ``on_timeout()`` is raised)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        main = asyncio.ensure_future(coro)
        watchers = {main}
        if p_task is not None:
            watchers.add(p_task)
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        watchers.add(gone)
        try:
            while True:
                left = None if deadline is None else deadline - loop.time()
                done, _ = await asyncio.wait(watchers, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    assert on_timeout is not None
                    raise on_timeout()
                if main in done:
                    return main.result()
                if gone in done:
                    raise ClientGone()
                if p_task is not None and p_task in done:
                    watchers.discard(p_task)
                    exc = p_task.exception()
                    if exc is not None:
                        raise exc  # P failed: D would wait for a push that never comes
        finally:
            for t in (main, gone):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t

    async def _post_json(self, url: str, body: dict, headers: dict, inst: Instance) -> dict:
        assert self.session is not None
        try:
            async with self.session.post(url, json=body, headers=headers, timeout=self.answer_timeout) as r:
                status, text, r_headers = r.status, await r.text(), r.headers
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self._leg_failed(inst, e)
            raise transport_error(inst, e, "unreachable") from None
        if status >= 400:
            inst.errors += 1
            raise engine_error(inst, status, text, r_headers)
        inst.served += 1
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise UpstreamError(502, "upstream_error", f"{inst.role} {inst.url} answered with non-JSON") from None

    async def _open_decode(self, d: Instance, endpoint: str, body: dict, headers: dict, stream: bool):
        """Send D's leg; return its response and its first bytes (they come once the
        KV arrived), or its whole body when not streaming. ``_watch`` bounds the time."""
        assert self.session is not None
        try:
            resp = await self.session.post(d.url + endpoint, json=body, headers=headers)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self._leg_failed(d, e)
            raise transport_error(d, e, "unreachable") from None
        try:
            if resp.status >= 400:
                text = await resp.text()
                resp.release()
                d.errors += 1
                raise engine_error(d, resp.status, text, resp.headers)
            # streaming: the relay goes on reading where the first chunk ended
            first = await (resp.content.readany() if stream else resp.read())
        except UpstreamError:
            raise
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            resp.close()
            self._leg_failed(d, e)
            raise transport_error(d, e, "failed") from None
        except BaseException:
            resp.close()
            raise
        return resp, first

    def _leg_failed(self, inst: Instance, exc: BaseException) -> None:
        inst.errors += 1
        if is_transport_failure(exc):
            self.health.failed(inst, f"leg failed: {exc!r}")

    def _leg_timed_out(self, inst: Instance) -> UpstreamError:
        inst.errors += 1
        return first_byte_timeout(inst)

    async def _reserve(self, p: Instance, d: Instance, body: dict, tid: str) -> LaneGrant:
        if self.reserver is None:
            return LaneGrant(None, None, None, "")
        if not p.fabric_host or not d.fabric_host:
            self.metrics.fallbacks.labels("no_fabric_host").inc()
            return LaneGrant(None, None, None, "no_fabric_host")
        nbytes = legs.estimate_prompt_tokens(body) * self.cfg.kv_bytes_per_token
        t = time.perf_counter()
        grant = await self.reserver.reserve(p.fabric_host, d.fabric_host, nbytes, tid)
        self.metrics.reservation.observe(time.perf_counter() - t)
        if grant.fallback:
            self.metrics.fallbacks.labels(grant.fallback.split(":")[0]).inc()
        return grant

    def _enter(self, p: Instance, d: Instance) -> None:
        for i in (p, d):
            i.inflight += 1
            self.metrics.inflight.labels(i.role, i.url).set(i.inflight)

    async def _finish(self, p: Instance, d: Instance, p_task: asyncio.Task | None, grant: LaneGrant, ok: bool) -> None:
        for i in (p, d):
            i.inflight -= 1
            self.metrics.inflight.labels(i.role, i.url).set(i.inflight)
        if p_task is not None and not p_task.done():
            if ok:
                # D answered, so P pushed; let P's own answer arrive without holding the client
                self._background.add(p_task)
                p_task.add_done_callback(self._p_leg_done)
            else:
                p_task.cancel()  # failed or abandoned request: abort the prefill too
                with contextlib.suppress(BaseException):
                    await p_task
        if grant.lease_id and self.reserver is not None:
            await self.reserver.release(grant.lease_id)  # idempotent; the connector releases it too

    def _p_leg_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("prefill leg failed after decode answered: %s", task.exception())

    # ---- admin -----------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization"), self.cfg.admin_token)

    def status(self) -> dict:
        return {
            "mode": self.cfg.mode, "policy": self.cfg.policy,
            "reservation": type(self.reserver).__name__ if self.reserver else None,
            "prefill": [i.to_dict() for i in self.pools["prefill"].all()],
            "decode": [i.to_dict() for i in self.pools["decode"].all()],
        }


_INFERENCE: dict[str, type[BaseModel]] = {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody}


class _InferenceFastPath:
    """ASGI front for the two inference endpoints; everything else goes to FastAPI.

    Per request and per relayed chunk, FastAPI's routing and Starlette's middleware
    wrappers cost about a fifth of the proxy's CPU; the inference calls need none of
    them (``Proxy.handle`` does its own parsing, validation and error answers)."""

    def __init__(self, app: FastAPI, proxy: Proxy):
        self.app, self.proxy = app, proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        schema = _INFERENCE.get(scope.get("path", "")) if scope["type"] == "http" else None
        if schema is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            response = await self.proxy.handle(Request(scope, receive, send), scope["path"], schema)
        except Exception:
            logger.exception("%s failed inside the proxy", scope["path"])
            response = _error(500, "internal proxy error (see the proxy's log)")
        await response(scope, receive, send)


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
            return _error(503, "no decode instance is configured")
        d = next((i for i in ds if i.healthy), ds[0])
        assert proxy.session is not None
        try:
            async with proxy.session.get(d.url + "/v1/models", timeout=proxy.answer_timeout) as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode {d.url} unreachable: {e!r}")

    @app.get("/health")
    async def health() -> Response:
        ok = bool(proxy.pools["prefill"].all() and proxy.pools["decode"].all())
        return JSONResponse({"status": "ok" if ok else "no instances"}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status() -> dict:
        return proxy.status()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> Response:
        if not proxy.authorized(request):
            return _error(401 if proxy.cfg.admin_token else 403, "admin token required" if proxy.cfg.admin_token
                          else "admin endpoints are disabled (start the proxy with --admin-token)")
        try:
            b = InstanceBody.model_validate_json(await request.body())
        except ValidationError as e:
            msg, fields = describe_validation_errors(e.errors())
            return _error(400 if is_invalid_json(e.errors()) else 422, msg, fields=fields)
        if b.role == "prefill" and proxy.cfg.mode != "pull" and not b.kv_addr:
            return _error(422, f"kv_addr: a prefill instance needs its KV side channel host:port in {proxy.cfg.mode} mode",
                          fields=["kv_addr"])
        new = proxy.pools[b.role].add(Instance(b.url.rstrip("/"), b.role, b.fabric_host, b.kv_addr, b.engine_id))
        return JSONResponse({"added" if new else "updated": b.url, "role": b.role}, status_code=201 if new else 200)

    @app.delete("/admin/instances")
    async def remove_instance(request: Request, role: str, url: str) -> Response:
        if not proxy.authorized(request):
            return _error(401 if proxy.cfg.admin_token else 403, "admin token required")
        if role not in proxy.pools:
            return _error(422, "role must be prefill or decode", fields=["role"])
        if not proxy.pools[role].remove(url.rstrip("/")):
            return _error(404, f"no {role} instance {url}")
        return JSONResponse({"removed": url, "role": role})

    if reservation_app is not None:
        app.mount("/reservation", reservation_app)  # its leases expire lazily: mounts get no lifespan
    return _InferenceFastPath(app, proxy)
