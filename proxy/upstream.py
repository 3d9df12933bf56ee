"""What the proxy answers when an engine (an upstream) fails or refuses a leg."""

from __future__ import annotations

import asyncio
import json
from typing import Mapping

import aiohttp

from kvpath.proxy.instances import Instance

# Engine statuses passed through as they are: the client's own fault (4xx) or the
# engine asking it to come back later (429, 503, with their Retry-After).
_PASSED = {400: "upstream_rejected", 404: "upstream_rejected", 413: "upstream_rejected",
           422: "upstream_rejected", 429: "upstream_busy", 503: "upstream_busy", 504: "upstream_timeout"}


class UpstreamError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.headers = dict(headers or {})


def engine_status(code: int) -> tuple[int, str]:
    """(status for the client, error kind) for an engine's HTTP error status."""
    kind = _PASSED.get(code)
    return (code, kind) if kind else (502, "upstream_error")


def engine_error(inst: Instance, status: int, text: str, headers: Mapping[str, str]) -> UpstreamError:
    if status in (401, 403):
        # the engine refused the proxy's credentials, not the client's: the proxy's fault
        return UpstreamError(502, "upstream_auth", f"{inst.role} {inst.url} refused the proxy's engine API key "
                             f"({status} {engine_message(text)}): give the proxy the engines' key "
                             f"(--engine-api-key-file, $KVPATH_ENGINE_API_KEY or $VLLM_API_KEY)")
    code, kind = engine_status(status)
    retry = headers.get("Retry-After")
    return UpstreamError(code, kind, f"{inst.role} {inst.url}: {engine_message(text)}",
                         {"Retry-After": retry} if retry and code in (429, 503) else None)


def exc_text(exc: BaseException) -> str:
    """``repr(exc)`` for messages and logs, except aiohttp's ClientResponseError family
    (a malformed answer, too many redirects), whose repr holds the request's headers and
    so the engine API key: its type and ``str`` (status, message, URL) instead."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{type(exc).__name__}({exc})"
    return repr(exc)


def transport_error(inst: Instance, exc: BaseException, what: str) -> UpstreamError:
    """No HTTP answer from an engine: a timeout is 504, anything else 502."""
    if isinstance(exc, aiohttp.ServerTimeoutError):  # sock_connect
        return UpstreamError(504, "upstream_timeout", f"upstream {inst.role} {inst.url} timed out: {exc}")
    if isinstance(exc, asyncio.TimeoutError):
        return first_byte_timeout(inst)
    return UpstreamError(502, "upstream_error", f"upstream {inst.role} {inst.url} {what}: {exc_text(exc)}")


def first_byte_timeout(inst: Instance) -> UpstreamError:
    return UpstreamError(504, "upstream_timeout",
                         f"upstream {inst.role} {inst.url} timed out: no answer within --first-byte-timeout-s")


def is_transport_failure(exc: BaseException) -> bool:
    """The connection failed (refused, reset, closed mid-answer): the engine may be
    gone. Timeouts are not counted: a busy engine is slow, not dead."""
    return isinstance(exc, aiohttp.ClientError) and not isinstance(exc, asyncio.TimeoutError)


def engine_message(text: str) -> str:
    try:
        d = json.loads(text)
        if isinstance(d, dict):
            err = d.get("error", d.get("message", d))
            if isinstance(err, dict):
                return str(err.get("message", err))
            return str(err)
    except json.JSONDecodeError:
        pass
    return text[:500]
