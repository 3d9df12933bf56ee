"""A request body size limit for the proxy and the reservation service (ASGI middleware).

A client that sends a body larger than ``max_bytes`` gets 413 with a message naming
the limit, before the app sees a byte of it: a stated ``Content-Length`` over the limit
is refused without reading, a chunked body as soon as what arrived passes it. So the
memory one request can make a server hold is bounded by the limit, whatever the
client claims.
"""

from __future__ import annotations

from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpath.web.errors import error_response


class BodyLimit:
    """``limit_for(scope)``: a smaller limit for some routes (default: ``max_bytes``)."""

    def __init__(self, app: ASGIApp, max_bytes: int, limit_for: Callable[[Scope], int] | None = None):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes, self.limit_for = app, max_bytes, limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = min(self.max_bytes, self.limit_for(scope)) if self.limit_for else self.max_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await self._refuse(scope, receive, send, limit)
        # Read the whole body here (bounded), then hand it to the app in one message;
        # later receive() calls go to the server (the app watches them for a disconnect).
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left mid-body
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._refuse(scope, receive, send, limit)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                out, whole = whole, None
                return out
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        resp = error_response(413, f"request body larger than {limit} bytes", headers={"Connection": "close"})
        await resp(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
