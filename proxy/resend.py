"""When a leg is sent again: only when the engine closed the pooled connection it went
out on before reading it. aiohttp's trace hooks (:func:`leg_tracer`) note whether a
request went out on a pooled connection and when it was written; :func:`closed_before_read`
judges a failed request by that. The loop that sends a leg is
:meth:`kvpath.proxy.engine_client.EngineClient.post`.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import aiohttp

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


def leg_tracer() -> aiohttp.TraceConfig:
    """The hooks that fill a request's ``trace_request_ctx`` dict: ``reused``, ``sent``."""
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
