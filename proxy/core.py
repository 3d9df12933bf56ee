"""The proxy's logic: for each request it picks a P and a D instance, asks for a lane
(push mode), runs the two legs and passes D's response through unchanged (streamed or
not). The HTTP side (routes, the ASGI fast path) is proxy/app.py; sending the legs
to the engines (aiohttp) and checking their answers is proxy/engine_client.py.

Each leg is bounded by the time to its first byte, D's stream by the gap between
its chunks (never by its length); a stream that fails after it started ends with
an error event (proxy/stream_guard.py). Instances failing health checks leave
rotation (proxy/health.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import aiohttp
import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from kvpath.proxy import legs
from kvpath.proxy.aio import cancel_and_wait
from kvpath.proxy.config import TRANSFER_ID_HEADER, ProxyConfig
from kvpath.proxy.engine_client import EngineClient, check_decode_answer
from kvpath.proxy.health import HealthChecker
from kvpath.proxy.instances import PLACED_POLICIES, Instance, InstancePool, NoInstance
from kvpath.proxy.metrics import ProxyMetrics
from kvpath.proxy.relay import RelayResponse, wait_for_disconnect
from kvpath.proxy.stream_guard import ChunkGapTimeout, EventFramer, GapWatch, error_event
from kvpath.proxy.tier import SharedInstances
from kvpath.proxy.upstream import UpstreamError, exc_text
from kvpath.reservation import wire
from kvpath.reservation.wire import AsyncReserver, FlowScope, LaneGrant
from kvpath.web.auth import bearer_ok
from kvpath.web.errors import describe_validation_errors, error_response

logger = logging.getLogger(__name__)
T = TypeVar("T")
_decode = msgspec.json.Decoder().decode  # strict JSON (no NaN), several times json.loads' speed

# where an instance is: shown by GET /status only with the admin token
PRIVATE_INSTANCE_FIELDS = ("url", "kv_addr", "fabric_host", "engine_id")


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
        self.health = HealthChecker(self.pools, cfg.health_interval_s, cfg.health_timeout_s, cfg.unhealthy_after,
                                    on_round=self.refresh_gauges)
        # a worker of a proxy tier (proxy/tier.py): the instance set it shares; None: alone
        self.shared: SharedInstances | None = None
        # what every request to an engine's API carries: vLLM's --api-key guards /v1/*
        # (not /health or /metrics, which the probes and scrapers use without it)
        self.engine_headers: dict[str, str] = (
            {"Authorization": f"Bearer {cfg.engine_api_key}"} if cfg.engine_api_key else {})
        self.engines = EngineClient(cfg, self.health)  # the legs' HTTP client
        self._background: set[asyncio.Task] = set()

    # ---- life cycle ------------------------------------------------------
    async def start(self) -> None:
        self.health.start(await self.engines.start())
        self.refresh_gauges()
        if self.shared is not None:
            task = asyncio.create_task(self.shared.follow(self.pools, self.refresh_gauges), name="kvpath-proxy-instances")
            self._background.add(task)

    async def stop(self) -> None:
        await self.health.stop()
        self.metrics.process_ended()
        for t in list(self._background):
            t.cancel()
        await self.engines.close()
        if self.reserver is not None:
            await self.reserver.close()

    # ---- request handling --------------------------------------------------
    async def handle(self, request: Request, endpoint: str, schema: type[BaseModel]) -> Response:
        t0 = time.perf_counter()
        try:
            raw = await request.body()
            body = _decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # (invalid UTF-8 is the second)
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
        tid = uuid.uuid4().hex  # the transfer id: both legs' X-Request-Id, and the answer's TRANSFER_ID_HEADER
        try:
            placed = await self._place(body, tid)
            if placed is None:
                p, d, grant = self.pools["prefill"].pick(), self.pools["decode"].pick(), None
            else:
                p, d, grant = placed
        except NoInstance as e:
            return self._count(endpoint, error_response(503, str(e)), "no_instance")
        try:
            resp = await self._run(request, endpoint, body, p, d, t0, tid, grant)
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
                   tid: str, placed: LaneGrant | None = None) -> Response:
        assert self.engines.session is not None
        stream = bool(body.get("stream"))
        # built here, never copied from the client's request: its own Authorization (a
        # key for this proxy, or a guess) never reaches an engine, the proxy's key does
        headers = {"X-Request-Id": tid, "Content-Type": "application/json", **self.engine_headers}
        answer_headers = {TRANSFER_ID_HEADER: tid}
        grant = LaneGrant()
        tokens = legs.estimate_prompt_tokens(body)
        self._enter(p, d, tokens)
        p_task: asyncio.Task | None = None
        handed_over = ok = False
        try:
            if self.cfg.mode == "push":
                grant = placed if placed is not None else await self._reserve(p, d, body, tid)
                p_body: dict | None
                p_body, d_body = legs.push_legs(body, p, tid, grant.lane, grant.lease_id)
                if not p.tp_size:
                    # P's TP size is not known yet: P's leg first, its answer names it (P
                    # holds the prefill's blocks until D registers), then D's leg with it
                    await self._watch(request, self.engines.post_json(p.url + endpoint, p_body, headers, p))
                    d_body = legs.with_p_tp(d_body, p.tp_size)
                    p_body = None
            elif self.cfg.mode == "inproc-push":
                p_body, d_body = legs.inproc_push_legs(body, p, tid, endpoint)
            else:
                p_body, d_body = legs.pull_prefill_leg(body), None
            if d_body is None:  # pull: P first, then D with what P returned
                p_out = await self._watch(request, self.engines.post_json(p.url + endpoint, p_body, headers, p))
                d_body = legs.decode_body(body, p_out.get("kv_transfer_params") or {})
            elif p_body is not None:
                p_task = asyncio.create_task(self.engines.post_json(p.url + endpoint, p_body, headers, p))
            d_resp, first = await self._watch(
                request, self.engines.open_decode(d, endpoint, d_body, headers, stream), p_task,
                self.cfg.first_byte_timeout_s, lambda: self.engines.leg_timed_out(d))
            ttfb = time.perf_counter() - t0
            self.metrics.first_token.observe(ttfb)
            if stream:
                handed_over = True
                async def never_relayed() -> None:
                    d_resp.close()
                    self.metrics.requests.labels(endpoint, "499").inc()
                    self.metrics.errors.labels("client_disconnect").inc()
                    await self._finish(p, d, p_task, grant, False, tokens)

                return RelayResponse(
                    self._relay(d_resp, first, p, d, p_task, grant, endpoint, t0, tokens),
                    status_code=d_resp.status, media_type=d_resp.headers.get("content-type", "text/event-stream"),
                    on_unstarted=never_relayed, headers=answer_headers,
                )
            content = first  # non-streaming: open_decode read the whole body
            d_resp.release()
            check_decode_answer(d, content)
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
                await self._finish(p, d, p_task, grant, ok, tokens)

    async def _relay(self, d_resp: aiohttp.ClientResponse, first: bytes, p: Instance, d: Instance,
                     p_task: asyncio.Task | None, grant: LaneGrant, endpoint: str, t0: float,
                     tokens: int) -> AsyncIterator[bytes]:
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
            self.engines.leg_failed(d, e)
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
            await self._finish(p, d, p_task, grant, ok, tokens)

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

    async def _place(self, body: dict, tid: str) -> tuple[Instance, Instance, LaneGrant] | None:
        """Policies joint and network (push mode, with a reservation service): P, D and the
        lane chosen together by the service (docs/placement.md). None: pick and reserve as
        the pools do (another policy, no service, an instance without a fabric host, a
        service that cannot place). A service that timed out or is unreachable may have
        placed: the pools pick, and nothing more is reserved (no double load; its lease
        ends what it reserved). Every fallback is counted with its reason."""
        if self.cfg.policy not in PLACED_POLICIES or self.cfg.mode != "push" or self.reserver is None:
            return None
        ps = [i for i in self.pools["prefill"].all() if i.healthy]
        ds = [i for i in self.pools["decode"].all() if i.healthy]
        if not ps or not ds:
            return None  # the pools' pick says why (503)
        if any(not i.fabric_host for i in (*ps, *ds)):
            self.metrics.fallbacks.labels("no_fabric_host").inc()
            return None
        tokens = legs.estimate_prompt_tokens(body)
        req = wire.PlaceRequest(
            prefill=[wire.EngineInfo(name=i.url, host=i.fabric_host, outstanding=i.inflight,
                                     queued_tokens=max(i.queued_tokens, 0), engine_id=i.engine_id) for i in ps],
            decode=[wire.EngineInfo(name=i.url, host=i.fabric_host, outstanding=i.inflight, engine_id=i.engine_id)
                    for i in ds],
            prompt_tokens=tokens, bytes=tokens * self.cfg.kv_bytes_per_token, transfer_id=tid, policy=self.cfg.policy)
        t = time.perf_counter()
        ans = await self.reserver.place(req)
        self.metrics.reservation.observe(time.perf_counter() - t)
        if isinstance(ans, str):
            reason = ans.split(":")[0]
            self.metrics.fallbacks.labels(f"place_{reason}").inc()
            if reason in ("timeout", "unreachable"):
                return self.pools["prefill"].pick(), self.pools["decode"].pick(), LaneGrant(fallback=reason)
            return None
        by_url = {i.url: i for i in (*ps, *ds)}
        if ans.prefill not in by_url or ans.decode not in by_url:  # not ours: give its lane back
            self.metrics.fallbacks.labels("place_bad_answer").inc()
            if ans.lease_id:
                await self.reserver.release(ans.lease_id)
            return None
        if ans.fallback:
            self.metrics.fallbacks.labels(ans.fallback).inc()
        grant = LaneGrant(ans.lane, ans.lease_id or None, ans.spine, ans.fallback)
        return by_url[ans.prefill], by_url[ans.decode], grant

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

    def _enter(self, p: Instance, d: Instance, tokens: int) -> None:
        p.queued_tokens += tokens  # P's leg answers after its prefill: queued or computing until then
        for i in (p, d):
            i.inflight += 1
            self.metrics.inflight_of(i.role, i.url).set(i.inflight)

    def _leave(self, i: Instance, tokens: int = 0) -> None:
        i.inflight -= 1
        i.queued_tokens -= tokens
        self.metrics.inflight_of(i.role, i.url).set(i.inflight)

    async def _finish(self, p: Instance, d: Instance, p_task: asyncio.Task | None, grant: LaneGrant, ok: bool,
                      tokens: int) -> None:
        self._leave(d)
        p_left = False
        try:
            if p_task is not None and not p_task.done():
                if ok:
                    # D answered, so P pushed; let P's own answer arrive without holding the
                    # client. P stays in flight until it does (least_outstanding counts it).
                    self._background.add(p_task)
                    p_task.add_done_callback(lambda t: self._p_leg_done(t, p, tokens))
                    p_left = True
                else:
                    await cancel_and_wait(p_task)  # failed or abandoned request: abort the prefill too
        finally:
            if not p_left:
                self._leave(p, tokens)
            if grant.lease_id and self.reserver is not None:
                await self.reserver.release(grant.lease_id)  # idempotent; the connector releases it too

    def _p_leg_done(self, task: asyncio.Task, p: Instance, tokens: int) -> None:
        self._background.discard(task)
        self._leave(p, tokens)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("prefill leg failed after decode answered: %s", task.exception())

    # ---- admin -----------------------------------------------------------
    def refresh_gauges(self) -> None:
        """The healthy-instance gauges: set, not computed at scrape, so that a tier's
        workers each leave theirs in the shared metrics (after every probe round)."""
        for role, pool in self.pools.items():
            self.metrics.healthy.labels(role).set(pool.healthy_count())

    def change_instances(self, fn: Callable[[], T]) -> T:
        """Run an admin change of the pools; in a tier, on its latest instance set, and
        shared with every worker (proxy/tier.py)."""
        out = fn() if self.shared is None else self.shared.change(self.pools, fn)
        self.refresh_gauges()
        return out

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
            **({"worker_pid": os.getpid()} if self.shared is not None and full else {}),
        }
