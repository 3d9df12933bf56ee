"""The proxy's HTTP client of the engines: one aiohttp session for every leg (and
GET /v1/models), a leg sent (again only as proxy/resend.py allows), P's JSON answer
checked, D's leg opened up to its first bytes. A leg that fails counts against its
instance, and a failed connection is reported to the health checker.

aiohttp, not httpx: httpx's connection pool scans every connection for every queued
request, which made the proxy CPU-bound at 64 concurrent streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import msgspec

from kvpath.proxy import legs
from kvpath.proxy.config import ProxyConfig
from kvpath.proxy.health import HealthChecker
from kvpath.proxy.instances import Instance
from kvpath.proxy.resend import POST_ATTEMPTS, closed_before_read, leg_tracer, unwritten
from kvpath.proxy.upstream import (UpstreamError, engine_error, exc_text, first_byte_timeout, is_transport_failure,
                                   transport_error)

logger = logging.getLogger(__name__)
# the legs' JSON: msgspec, several times the speed of the json module (a leg's body is
# the client's, decoded by msgspec, so it encodes back exactly)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

# below uvicorn's (so vLLM's) default keep-alive timeout of 5 s, with room for this
# proxy's loop being late to read an answer (the idle clock starts when it does)
IDLE_KEEPALIVE_S = 2.0


class EngineClient:
    """``session``: None until :meth:`start`. ``answer_timeout``: the bound on a whole
    non-streamed answer (P's leg, D's when not streaming, /v1/models)."""

    def __init__(self, cfg: ProxyConfig, health: HealthChecker):
        self.cfg = cfg
        self.health = health
        self.session: aiohttp.ClientSession | None = None
        self.answer_timeout = aiohttp.ClientTimeout(total=cfg.first_byte_timeout_s, sock_connect=cfg.connect_timeout_s)

    async def start(self) -> aiohttp.ClientSession:
        # no total: a stream may last as long as it keeps sending (GapWatch bounds its gaps)
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s),
            # idle connections are dropped before the engines' own keep-alive timeout
            # (uvicorn's 5 s): else a request races the engine closing the one it takes
            connector=aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0,
                                           keepalive_timeout=IDLE_KEEPALIVE_S),
            auto_decompress=False,
            trace_configs=[leg_tracer()],
        )
        return self.session

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    async def post_json(self, url: str, body: dict, headers: dict, inst: Instance) -> dict:
        """Send a leg whose whole answer is a JSON object (P's; D's in no mode) and return it."""
        assert self.session is not None
        try:
            async with await self.post(url, body, headers, timeout=self.answer_timeout) as r:
                status, raw, r_headers = r.status, await r.read(), r.headers
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self.leg_failed(inst, e)
            raise transport_error(inst, e, "unreachable") from None
        if status >= 400:
            inst.errors += 1
            raise engine_error(inst, status, raw.decode("utf-8", "replace"), r_headers)
        try:
            out = _decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
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
            learn_tp(inst, legs.p_tp_of(out))
        return out

    async def open_decode(self, d: Instance, endpoint: str, body: dict, headers: dict, stream: bool):
        """Send D's leg; return its response and its first bytes (they come once the
        KV arrived), or its whole body when not streaming. The caller bounds the time."""
        assert self.session is not None
        try:
            resp = await self.post(d.url + endpoint, body, headers, resend=self.cfg.mode != "pull")
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            self.leg_failed(d, e)
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
            self.leg_failed(d, e)
            raise transport_error(d, e, "failed") from None
        except BaseException:
            resp.close()
            raise
        return resp, first

    async def post(self, url: str, body: dict, headers: dict, resend: bool = True,
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
                return await self.session.post(url, data=_encode(body), headers=headers, trace_request_ctx=ctx, **kw)
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

    def leg_failed(self, inst: Instance, exc: BaseException) -> None:
        inst.errors += 1
        if is_transport_failure(exc):
            self.health.failed(inst, f"leg failed: {exc_text(exc)}")

    @staticmethod
    def leg_timed_out(inst: Instance) -> UpstreamError:
        inst.errors += 1
        return first_byte_timeout(inst)


def learn_tp(p: Instance, tp: int) -> None:
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


def check_decode_answer(d: Instance, content: bytes) -> None:
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
