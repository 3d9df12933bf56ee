"""Ending a relayed stream cleanly when D's side of it fails.

Once D's stream is being relayed the client has its 200, so a failure can only be
told inside the stream: as vLLM does, with an error event and ``[DONE]``. For that
event to parse, the client must never have been sent half an event, and a stalled
stream must be noticed at all: ``EventFramer`` and ``GapWatch``.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

_TYPES = {502: "BadGatewayError", 504: "GatewayTimeoutError"}  # vLLM's "<HTTP phrase>Error" style
MAX_HELD = 1 << 20  # an "event" this long without its blank line is not SSE: pass it on as it is


class ChunkGapTimeout(Exception):
    """D's stream sent nothing for longer than the gap timeout."""


def error_event(message: str, code: int) -> bytes:
    """vLLM's stream error (``ErrorResponse`` as a data event), then the end marker."""
    err = {"error": {"message": message, "type": _TYPES.get(code, "InternalServerError"), "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\n".encode() + b"data: [DONE]\n\n"


class EventFramer:
    """Passes a byte stream on in whole SSE events (ending in a blank line).

    A chunk from the socket can end inside an event; that tail is held until the
    rest comes. On success the output is byte-identical to the input; on failure the
    held tail (half an event) is dropped so that an error event can follow."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if chunk.endswith(b"\n\n"):  # the usual case: one or more whole events
            return chunk
        cut = chunk.rfind(b"\n\n") + 2 if b"\n\n" in chunk else 0
        if len(chunk) - cut > MAX_HELD:
            return chunk
        self._held = chunk[cut:]
        return chunk[:cut]

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held


class GapWatch:
    """Fails a stream's pending read once D has sent nothing for ``gap_s``.

    One timer per stream, re-armed only when it fires: marking a chunk costs a clock
    read, not a timer. Time the relay spends sending to a slow client is not D's
    gap, so only time spent waiting on D counts."""

    def __init__(self, reader: aiohttp.StreamReader, gap_s: float, what: str):
        self._loop = asyncio.get_running_loop()
        self._reader, self._gap, self._what = reader, gap_s, what
        self._since: float | None = None  # when the pending read on D began; None: not reading
        self._handle = self._loop.call_later(gap_s, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()

    def got_chunk(self) -> None:
        self._since = None

    def cancel(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        due = now + self._gap if self._since is None else self._since + self._gap
        if due - now > 0.001:  # (timers may run a hair early)
            self._handle = self._loop.call_at(due, self._check)
            return
        self._reader.set_exception(ChunkGapTimeout(
            f"{self._what} stream stalled: no data for {self._gap:g} s (--chunk-gap-timeout-s)"))
