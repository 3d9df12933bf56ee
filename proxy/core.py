"""The proxy's logic: for each request it picks a P and a D instance, asks for a lane
(push mode), runs the two legs and passes D's response through unchanged (streamed or
not). The HTTP side (routes, the ASGI fast path) is proxy/app.py.

The upstream legs use aiohttp: httpx's connection pool scans every connection for
every queued request, which made the proxy CPU-bound at 64 concurrent streams.

Each leg is bounded by the time to its first byte, D's stream by the gap between
its chunks (never by its length); a stream that fails after it started ends with
an error event (proxy/stream_guard.py). Instances failing health checks leave
rotation (proxy/health.py).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from kvpath.proxy import legs
from kvpath.proxy.aio import cancel_and_wait
from kvpath.proxy.config import TRANSFER_ID_HEADER, ProxyConfig
from kvpath.proxy.health import HealthChecker
from kvpath.proxy.instances import Instance, InstancePool, NoInstance
from kvpath.proxy.metrics import ProxyMetrics
from kvpath.proxy.relay import RelayResponse, wait_for_disconnect
from kvpath.proxy.stream_guard import ChunkGapTimeout, EventFramer, GapWatch, error_event
from kvpath.web.auth import bearer_ok
from kvpath.web.errors import describe_validation_errors, error_response
from kvpath.proxy.upstream import (UpstreamError, engine_error, exc_text, first_byte_timeout, is_transport_failure,
                                   transport_error)
from kvpath.reservation.wire import AsyncReserver, FlowScope, LaneGrant

logger = logging.getLogger(__name__)

# below uvicorn's (so vLLM's) default keep-alive timeout of 5 s, with room for this
# proxy's loop being late to read an answer (the idle clock starts when it does)
IDLE_KEEPALIVE_S = 2.0
# where an instance is: shown by GET /status only with the admin token
PRIVATE_INSTANCE_FIELDS = ("url", "kv_addr", "fabric_host", "engine_id")
POST_ATTEMPTS = 3  # a leg is sent again when its pooled connection turned out closed (below)
# ... and only when that showed within this long of writing it: a whole uvicorn keep-alive
# period, since on a starved machine (pull mode's in-tree connectors busy-spin both cores)
# the proxy sees the close late; still far below the time a vLLM engine that read the leg
# and died takes to come back (a dead one refuses the resend)
RESEND_WINDOW_S = 5.0


async def _mark_reused(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    """aiohttp trace hook: the request went out on a pooled connection."""
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


async def _mark_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    """aiohttp trace hook: the request's headers were written (when, on the loop's clock)."""
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["sent"] = asyncio.get_running_loop().time()


def _leg_tracer() -> aiohttp.TraceConfig:
    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(_mark_reused)
    tc.on_request_headers_sent.append(_mark_sent)
    return tc


def unwritten(exc: BaseException) -> bool:
    """aiohttp could not write the request at all (the connection was already closed)."""
    return isinstance(exc, aiohttp.ClientOSError) and "write request body" in str(exc)


def closed_before_read(exc: BaseException, ctx: dict[str, Any], now: float) -> bool:
    """Did the engine close a pooled connection as this request went out, so that it
    never read the request? A clean close (ServerDisconnectedError) or a reset (the
    request's bytes unread: ECONNRESET, EPIPE) on a connection taken from the pool,
    within RESEND_WINDOW_S of the request being written. An engine that read a request
    answers it (uvicorn closes a keep-alive connection only while no request is in
    it), so a close after that window may be one that was read: never sent again."""
    if not ctx.get("reused"):
        return False
    if unwritten(exc):
        return True
    if isinstance(exc, aiohttp.ServerDisconnectedError) and not isinstance(exc.message, str):
        return False  # cut inside an answer's head (aiohttp keeps it as the message): the request was read
    reset = isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)
    if not (isinstance(exc, aiohttp.ServerDisconnectedError) or reset
            or isinstance(exc, aiohttp.ClientConnectionResetError)):
        return False
    sent = ctx.get("sent")
    return sent is None or now - sent <= RESEND_WINDOW_S


class ClientGone(Exception):
    """The client closed its connection before the answer started."""


class Proxy:
    """``reserver``: where push mode gets its lanes (None: P's connectors take the
    hash's lane, or reserve when their pushes start with reserve_at=push)."""

    def __init__(self, cfg: ProxyConfig, prefill: list[Instance], decode: list[Instance],
                 reserver: AsyncReserver | None = None):
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
        # what every request to an engine's API carries: vLLM's --api-key guards /v1/*
        # (not /health or /metrics, which the probes and scrapers use without it)
        self.engine_headers: dict[str, str] = (
            {"Authorization": f"Bearer {cfg.engine_api_key}"} if cfg.engine_api_key else {})
        self.session: aiohttp.ClientSession | None = None
        # whole non-streamed answers (P's leg, D's when not streaming, /v1/models)
        self.answer_timeout = aiohttp.ClientTimeout(total=cfg.first_byte_timeout_s, sock_connect=cfg.connect_timeout_s)
        self._background: set[asyncio.Task] = set()

    # ---- life cycle ------------------------------------------------------
    async def start(self) -> None:
        # no total: a stream may last as long as it keeps sending (GapWatch bounds its gaps)
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
            # idle connections are dropped before the engines' own keep-alive timeout
            # (uvicorn's 5 s): else a request races the engine closing the one it takes
            connector=aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0,
                                           keepalive_timeout=IDLE_KEEPALIVE_S),
            auto_decompress=False,
            trace_configs=[_leg_tracer()],
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
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return self._count(endpoint, error_response(400, "request body is not valid JSON"), "bad_json")
        if not isinstance(body, dict):
            return self._count(endpoint, error_response(400, "request body must be a JSON object"), "bad_json")
        try:
            schema.model_validate(body)
        except ValidationError as e:
            msg, fields = describe_validation_errors(e.errors())
            return self._count(endpoint, error_response(422, msg, fields=fields), "schema")
        refused = legs.unsupported_field(body, self.cfg.mode)
        if refused:
            return self._count(endpoint, error_response(400, refused[1], fields=[refused[0]]), "unsupported")
        body.pop("kv_transfer_params", None)  # the proxy owns the transfer parameters
        try:
            p, d = self.pools["prefill"].pick(), self.pools["decode"].pick()
        except NoInstance as e:
            return self._count(endpoint, error_response(503, str(e)), "no_instance")
        tid = uuid.uuid4().hex  # the transfer id: both legs' X-Request-Id, and the answer's TRANSFER_ID_HEADER
        try:
            resp = await self._run(request, endpoint, body, p, d, t0, tid)
        except UpstreamError as e:
            logger.warning("%s -> %d %s: %s", endpoint, e.status, e.kind, e.message)
            return self._count(endpoint, error_response(e.status, self.for_client(e.message),
                                                        {**e.headers, TRANSFER_ID_HEADER: tid}), e.kind)
        except ClientGone:
            # nobody reads this answer; 499 (nginx's "client closed request") keeps the metrics honest
            return self._count(endpoint, error_response(499, "client closed the request", {TRANSFER_ID_HEADER: tid}),
                               "client_disconnect")
        return resp

    def _count(self, endpoint: str, resp: Response, error_kind: str | None = None) -> Response:
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        if error_kind:
            self.metrics.errors.labels(error_kind).inc()
        return resp

    async def _run(self, request: Request, endpoint: str, body: dict, p: Instance, d: Instance, t0: float,
                   tid: str) -> Response:
        assert self.session is not None
        stream = bool(body.get("stream"))
        # built here, never copied from the client's request: its own Authorization (a
        # key for this proxy, or a guess) never reaches an engine, the proxy's key does
        headers = {"X-Request-Id": tid, **self.engine_headers}
        answer_headers = {TRANSFER_ID_HEADER: tid}
        grant = LaneGrant()
        self._enter(p, d)
        p_task: asyncio.Task | None = None
        handed_over = ok = False
        try:
            if self.cfg.mode == "push":
                grant = await self._reserve(p, d, body, tid)
                p_body: dict | None
                p_body, d_body = legs.push_legs(body, p, tid, grant.lane, grant.lease_id)
                if not p.tp_size:
                    # P's TP size is not known yet: P's leg first, its answer names it (P
                    # holds the prefill's blocks until D registers), then D's leg with it
                    await self._watch(request, self._post_json(p.url + endpoint, p_body, headers, p))
                    d_body = legs.with_p_tp(d_body, p.tp_size)
                    p_body = None
            elif self.cfg.mode == "inproc-push":
                p_body, d_body = legs.inproc_push_legs(body, p, tid, endpoint)
            else:
                p_body, d_body = legs.pull_prefill_leg(body), None
            if d_body is None:  # pull: P first, then D with what P returned
                p_out = await self._watch(request, self._post_json(p.url + endpoint, p_body, headers, p))
                d_body = legs.decode_body(body, p_out.get("kv_transfer_params") or {})
            elif p_body is not None:
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
                    on_unstarted=never_relayed, headers=answer_headers,
                )
            content = first  # non-streaming: _open_decode read the whole body
            d_resp.release()
            self._check_decode_answer(d, content)
            ok = True
            d.served += 1
            self.metrics.e2e.observe(time.perf_counter() - t0)
            return self._count(endpoint, Response(content, status_code=d_resp.status, headers=answer_headers,
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
            message = str(e) if code == 504 else f"decode {d.url} stream broke: {exc_text(e)}"
            status = str(code)
            self._leg_failed(d, e)
            self.metrics.errors.labels("upstream_stream_error").inc()
            logger.warning("%s -> stream error %d: %s", endpoint, code, message)
            yield error_event(self.for_client(message), code)
        finally:
            watch.cancel()
            self.metrics.requests.labels(endpoint, status).inc()
            if ok:
                d_resp.release()
            else:
                d_resp.close()  # drop the connection: the engine sees the client leave and aborts
            await self._finish(p, d, p_task, grant, ok)

    async def _watch(self, request: Request, coro: Awaitable[Any], p_task: asyncio.Task | None = None,
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
            await cancel_and_wait(*(t for t in (main, gone) if not t.done()))

    async def _post_json(self, url: str, body: dict, headers: dict, inst: Instance) -> dict:
        assert self.session is not None
        try:
            async with await self._post(url, body, headers, timeout=self.answer_timeout) as r:
                status, text, r_headers = r.status, await r.text(), r.headers
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self._leg_failed(inst, e)
            raise transport_error(inst, e, "unreachable") from None
        if status >= 400:
            inst.errors += 1
            raise engine_error(inst, status, text, r_headers)
        try:
            out = json.loads(text)
        except json.JSONDecodeError:
            inst.errors += 1
            raise UpstreamError(502, "upstream_error", f"{inst.role} {inst.url} answered with non-JSON") from None
        if not isinstance(out, dict):
            inst.errors += 1
            raise UpstreamError(502, "upstream_error", f"{inst.role} {inst.url} answered with JSON that is not an object")
        kv = out.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("error"):
            # the engine did not serve the leg as one (a kv_role that does not fit it):
            # D would wait for a push that never comes
            inst.errors += 1
            raise UpstreamError(502, "upstream_error",
                                f"{inst.role} {inst.url} did not serve the leg: {str(kv['error'])[:300]}")
        inst.served += 1
        if self.cfg.mode == "push" and inst.role == "prefill":
            self._learn_tp(inst, legs.p_tp_of(out))
        return out

    @staticmethod
    def _learn_tp(p: Instance, tp: int) -> None:
        """P's TP size from its own answer (every push-mode P answer names it): learned
        once, and again when a restarted P names another. P knows its TP size best: an
        operator's tp= that P contradicts is replaced, with a warning."""
        if not tp:
            if not p.tp_size and not p.tp_unnamed_warned:
                # an older connector, or an answer without params: every request to it goes P first
                p.tp_unnamed_warned = True
                logger.warning("prefill %s answered without its TP size (kv_transfer_params.kvpath.tp_size): its "
                               "requests send P's leg before D's until an answer names it (or give tp=)", p.url)
            return
        if tp != p.tp_size:
            if p.tp_size and not p.tp_learned:
                logger.warning("prefill %s: its answer names TP size %d, not the %d given (tp=): using %d", p.url,
                               tp, p.tp_size, tp)
            else:
                logger.info("prefill %s: TP size %d (learned from its answer)", p.url, tp)
            p.tp_size, p.tp_learned = tp, True

    async def _open_decode(self, d: Instance, endpoint: str, body: dict, headers: dict, stream: bool):
        """Send D's leg; return its response and its first bytes (they come once the
        KV arrived), or its whole body when not streaming. ``_watch`` bounds the time."""
        assert self.session is not None
        try:
            resp = await self._post(d.url + endpoint, body, headers, resend=self.cfg.mode != "pull")
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self._leg_failed(d, e)
            raise transport_error(d, e, "unreachable") from None
        try:
            if resp.status >= 400:
                text = await resp.text()
                resp.release()
                d.errors += 1
                err = engine_error(d, resp.status, text, resp.headers)
                if err.kind == "upstream_error" and self.cfg.mode != "pull":  # not 503 (busy) or 504
                    # a failed KV load reaches vLLM's clients as a bare "Internal server
                    # error" (vLLM 0.32 passes a connector no way to say why): point at
                    # the log line that does, D's request id holds the transfer id
                    err.message += (f" (if D's KV load failed, D's log names the cause: its request id holds "
                                    f"the transfer id {headers.get('X-Request-Id', '?')})")
                raise err
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

    async def _post(self, url: str, body: dict, headers: dict, resend: bool = True,
                    **kw: Any) -> aiohttp.ClientResponse:
        """POST a leg; once more, up to POST_ATTEMPTS tries, when the engine closed the
        pooled connection it went out on before reading it (:func:`closed_before_read`):
        an idle keep-alive connection that the engine closed as the request was written.
        On a busy machine the proxy reads an answer late and so starts that connection's
        idle clock late (seen in CI: six pull-mode P legs cut at once). ``resend=False``
        (pull mode's D leg, which reads P's blocks by id) only retries a request that
        could not be written at all."""
        assert self.session is not None
        loop = asyncio.get_running_loop()
        for attempt in range(POST_ATTEMPTS):
            ctx: dict[str, Any] = {"reused": False}
            try:
                return await self.session.post(url, json=body, headers=headers, trace_request_ctx=ctx, **kw)
            except aiohttp.ClientError as e:
                if attempt == POST_ATTEMPTS - 1 or not closed_before_read(e, ctx, loop.time()) or not (
                        resend or unwritten(e)):
                    # what decided it, for the next time a leg is cut on a busy machine
                    sent = ctx.get("sent")
                    logger.info("a leg to %s failed on try %d (%s): %s connection, %s", url, attempt + 1,
                                exc_text(e), "pooled" if ctx.get("reused") else "new",
                                "not written" if sent is None else f"written {loop.time() - sent:.2f} s before")
                    raise
                logger.info("a pooled connection to %s was closed before the request was read (%s): sent again",
                            url, exc_text(e))
        raise AssertionError("unreachable")

    def _leg_failed(self, inst: Instance, exc: BaseException) -> None:
        inst.errors += 1
        if is_transport_failure(exc):
            self.health.failed(inst, f"leg failed: {exc_text(exc)}")

    def _leg_timed_out(self, inst: Instance) -> UpstreamError:
        inst.errors += 1
        return first_byte_timeout(inst)

    async def _reserve(self, p: Instance, d: Instance, body: dict, tid: str) -> LaneGrant:
        if self.reserver is None:
            return LaneGrant()
        if not p.fabric_host or not d.fabric_host:
            self.metrics.fallbacks.labels("no_fabric_host").inc()
            return LaneGrant(fallback="no_fabric_host")
        nbytes = legs.estimate_prompt_tokens(body) * self.cfg.kv_bytes_per_token
        t = time.perf_counter()
        # the flows of this engine pair only (every TP rank pair of theirs), when the
        # pool names the engines; else every registered pair of the two hosts
        scope = FlowScope(p_engine=p.engine_id, d_engine=d.engine_id) if p.engine_id or d.engine_id else None
        grant = await self.reserver.reserve(p.fabric_host, d.fabric_host, nbytes, transfer_id=tid, scope=scope)
        self.metrics.reservation.observe(time.perf_counter() - t)
        if grant.fallback:
            self.metrics.fallbacks.labels(grant.fallback.split(":")[0]).inc()
        return grant

    def _enter(self, p: Instance, d: Instance) -> None:
        for i in (p, d):
            i.inflight += 1
            self.metrics.inflight.labels(i.role, i.url).set(i.inflight)

    def _leave(self, i: Instance) -> None:
        i.inflight -= 1
        self.metrics.inflight.labels(i.role, i.url).set(i.inflight)

    async def _finish(self, p: Instance, d: Instance, p_task: asyncio.Task | None, grant: LaneGrant, ok: bool) -> None:
        self._leave(d)
        p_left = False
        try:
            if p_task is not None and not p_task.done():
                if ok:
                    # D answered, so P pushed; let P's own answer arrive without holding the
                    # client. P stays in flight until it does (least_outstanding counts it).
                    self._background.add(p_task)
                    p_task.add_done_callback(lambda t: self._p_leg_done(t, p))
                    p_left = True
                else:
                    await cancel_and_wait(p_task)  # failed or abandoned request: abort the prefill too
        finally:
            if not p_left:
                self._leave(p)
            if grant.lease_id and self.reserver is not None:
                await self.reserver.release(grant.lease_id)  # idempotent; the connector releases it too

    def _check_decode_answer(self, d: Instance, content: bytes) -> None:
        """D computed the answer itself when its kv_role does not fit a D leg: the output
        is right, so it is passed on, but P's KV went nowhere (its blocks wait for their
        lease): counted as D's error and logged. (Cheap test first: this is the hot path.)"""
        if b'"kv_role"' not in content:
            return
        try:
            kv = json.loads(content).get("kv_transfer_params") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(kv, dict) and kv.get("error"):
            d.errors += 1
            logger.warning("decode %s did not serve its leg as one: %s", d.url, str(kv["error"])[:300])

    def _p_leg_done(self, task: asyncio.Task, p: Instance) -> None:
        self._background.discard(task)
        self._leave(p)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("prefill leg failed after decode answered: %s", task.exception())

    # ---- admin -----------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization"), self.cfg.admin_token)

    def for_client(self, message: str) -> str:
        """``message`` with every engine address (URL, host:port, side channel) named by
        its role and index instead, as ``GET /status`` without the admin token shows them:
        error answers reach clients, who must not learn where the engines listen (the
        proxy's log keeps the addresses)."""
        names = {addr: f"{role} #{n}" for role, pool in self.pools.items() for n, inst in enumerate(pool.all())
                 for addr in (inst.url, inst.url.split("://", 1)[-1], inst.kv_addr) if addr}
        for addr in sorted(names, key=len, reverse=True):  # longest first: one address may prefix another
            message = message.replace(addr, names[addr])
        return message

    def status(self, full: bool = False) -> dict:
        """The proxy's state. ``full`` (the admin token was given): every instance with
        its URL, KV address, fabric host and engine id; else each instance by its role
        and position only, with its counts and health (dashboards, readiness checks)."""
        def view(i: int, inst: Instance) -> dict:
            d = inst.to_dict()
            if not full:
                for k in PRIVATE_INSTANCE_FIELDS:
                    d.pop(k, None)
            return {"index": i, **d}

        return {
            "mode": self.cfg.mode, "policy": self.cfg.policy,
            "reservation": type(self.reserver).__name__ if self.reserver else None,
            "prefill": [view(n, i) for n, i in enumerate(self.pools["prefill"].all())],
            "decode": [view(n, i) for n, i in enumerate(self.pools["decode"].all())],
            "redacted": not full,
        }
