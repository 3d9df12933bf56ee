"""A lean streamed ASGI response for relaying an engine's SSE stream.

Starlette's ``StreamingResponse`` opens an anyio task group per response to watch
for the client leaving (uvicorn speaks ASGI 2.3, where sends to a gone client are
silently dropped). At hundreds of streams that set-up is a measurable share of the
proxy's CPU, so this response does the same with one plain asyncio task that waits
for ``http.disconnect`` and cancels the relay.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvpath.proxy.aio import cancel_and_wait


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone. Call once the request body is read: the next
    ASGI message can then only be the disconnect, so waiting costs nothing (unlike
    polling ``Request.is_disconnected()``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    # A Response subclass so FastAPI passes it through; Response.__init__ is not
    # called because there is no body to render.
    def __init__(
        self, chunks: AsyncIterator[bytes], status_code: int, media_type: str,
        on_unstarted: Callable[[], Awaitable[None]] | None = None, headers: Mapping[str, str] | None = None,
    ):
        # ``on_unstarted``: the clean-up of a relay whose generator never ran (the
        # client left while the response started, or it was never sent): closing a
        # generator that never started skips its ``finally``.
        self.chunks = chunks
        self.on_unstarted = on_unstarted
        self.started = False
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.raw_headers = [(b"content-type", media_type.encode("latin-1"))]
        self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None

        async def watch() -> None:
            await wait_for_disconnect(receive)
            relay.cancel()  # the generator's own clean-up then cancels the engine's leg

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.started = True  # from the first __anext__ on, the generator cleans up after itself
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done():
                raise  # cancelled from outside: not a client disconnect
            relay.uncancel()  # the client left: end quietly, as Starlette does
        finally:
            await cancel_and_wait(watcher)
            await self.abandon()

    async def abandon(self) -> None:
        """Close the relay; run ``on_unstarted`` when its generator never ran."""
        aclose = getattr(self.chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if not self.started and self.on_unstarted is not None:
            self.started = True  # once
            await self.on_unstarted()
