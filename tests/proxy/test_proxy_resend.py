"""A leg whose pooled connection the engine closed as it went out is sent again (the
engine never read it: the request could not be written, or the connection was closed
or reset within RESEND_WINDOW_S of writing it); anything else is not, nor pull mode's D
leg, and the pool lets idle connections go before the engine does."""

import asyncio
import errno

import aiohttp
import pytest

from kvpath.proxy import engine_client, resend
from kvpath.proxy.config import ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance


class FlakySession:
    """Fails with ``failures`` in turn, each on a pooled (reused) connection."""

    def __init__(self, failures: list[Exception]):
        self.failures, self.calls = list(failures), 0

    async def post(self, url, *, trace_request_ctx, **kw):
        self.calls += 1
        if self.failures:
            trace_request_ctx["reused"] = True
            raise self.failures.pop(0)
        return "answer"


def proxy_with(session) -> Proxy:
    px = Proxy(ProxyConfig(), [Instance("http://p", "prefill", kv_addr="127.0.0.1:1")], [Instance("http://d", "decode")])
    px.engines.session = session
    return px


def closed() -> aiohttp.ClientOSError:
    return aiohttp.ClientOSError(None, "Can not write request body for http://d/v1/completions")


def test_a_leg_is_sent_again_while_its_pooled_connections_turn_out_closed():
    s = FlakySession([closed(), closed()])  # two of a burst's pooled connections were closed
    assert asyncio.run(proxy_with(s).engines.post("http://d/v1/completions", {}, {})) == "answer"
    assert s.calls == 3


def test_it_gives_up_after_three_tries_and_never_resends_other_errors():
    s = FlakySession([closed()] * resend.POST_ATTEMPTS)
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(proxy_with(s).engines.post("http://d/v1/completions", {}, {}))
    assert s.calls == resend.POST_ATTEMPTS
    s = FlakySession([aiohttp.ClientOSError(errno.ECONNREFUSED, "Connection refused")])  # not a close
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(proxy_with(s).engines.post("http://d/v1/completions", {}, {}))
    assert s.calls == 1
    # a reset of a pooled connection (the request's bytes unread) is sent again, but not
    # in pull mode's D leg, which reads P's blocks by id
    reset = aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer")
    s = FlakySession([reset])
    assert asyncio.run(proxy_with(s).engines.post("http://d/v1/completions", {}, {})) == "answer"
    s = FlakySession([reset])
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(proxy_with(s).engines.post("http://d/v1/completions", {}, {}, resend=False))
    assert s.calls == 1


def test_idle_pooled_connections_are_dropped_before_the_engines_keep_alive_ends():
    async def go():
        px = proxy_with(None)
        await px.start()
        try:
            return px.engines.session.connector._keepalive_timeout
        finally:
            await px.stop()

    assert asyncio.run(go()) == engine_client.IDLE_KEEPALIVE_S < 5.0  # uvicorn's default keep-alive timeout



def test_the_proxy_keeps_its_clients_idle_connections_longer_than_their_pools_do():
    from kvpath.proxy import cli

    assert cli.CLIENT_KEEPALIVE_S > 15  # httpx keeps an idle connection 5 s, aiohttp 15 s


class DisconnectingSession:
    """Closes the connection before answering; ``reused`` says whether aiohttp would
    have sent the request on a pooled connection."""

    def __init__(self, reused: list[bool]):
        self.reused, self.calls = list(reused), 0

    async def post(self, url, *, trace_request_ctx, **kw):
        self.calls += 1
        if self.reused:
            trace_request_ctx["reused"] = self.reused.pop(0)
            raise aiohttp.ServerDisconnectedError()
        return "answer"


def test_a_connection_cut_inside_an_answers_head_is_not_sent_again():
    # aiohttp keeps the part of the answer it read as the error's message: the engine read the leg
    s = FlakySession([aiohttp.ServerDisconnectedError(message=object())])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        asyncio.run(proxy_with(s).engines.post("http://p/v1/completions", {}, {}))
    assert s.calls == 1


def test_a_pooled_connection_closed_before_any_answer_is_sent_again_a_fresh_one_never():
    s = DisconnectingSession([True, True])
    assert asyncio.run(proxy_with(s).engines.post("http://p/v1/completions", {}, {})) == "answer"
    assert s.calls == 3
    s = DisconnectingSession([True, False])  # the second went out on a new connection: the engine may be gone
    with pytest.raises(aiohttp.ServerDisconnectedError):
        asyncio.run(proxy_with(s).engines.post("http://p/v1/completions", {}, {}))
    assert s.calls == 2


class KeepAliveCloser:
    """A real HTTP/1.1 server: it answers the first request on each connection and
    keeps the connection open; when the next request's bytes come it closes the
    connection without reading them, as an engine whose keep-alive timer fired as that
    request went out does (``read_then_close_after``: it reads the request whole and
    closes that long after, unanswered, as an engine that saw it and died would)."""

    def __init__(self, answer_first: bool = True, read_then_close_after: float | None = None):
        self.answer_first, self.read_then_close_after = answer_first, read_then_close_after
        self.requests, self.connections = 0, 0

    async def _read_request(self, reader: asyncio.StreamReader) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.answer_first:
                await self._read_request(reader)
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
            if self.read_then_close_after is not None:
                await self._read_request(reader)
                self.requests += 1
                await asyncio.sleep(self.read_then_close_after)
            else:
                if await reader.read(1):  # the next request's first byte: the rest stays unread
                    self.requests += 1
        except asyncio.IncompleteReadError:
            pass
        writer.close()


async def _post_twice(server: KeepAliveCloser) -> list:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions"
    px = proxy_with(None)
    await px.start()
    out = []
    try:
        for _ in range(2):
            try:
                async with await px.engines.post(url, {"prompt": "x"}, {}) as r:
                    await r.read()  # read whole, the connection goes back to the pool
                    out.append(r.status)
            except aiohttp.ClientError:
                out.append("failed")
    finally:
        await px.stop()
        srv.close()
        await srv.wait_closed()
    return out


def test_through_aiohttp_a_leg_on_a_pooled_connection_the_engine_closed_is_answered(monkeypatch):
    monkeypatch.setattr(resend, "RESEND_WINDOW_S", 10.0)  # a busy CI machine may see the close late
    server = KeepAliveCloser()
    assert asyncio.run(_post_twice(server)) == [200, 200]
    # the second leg went out on the first (pooled) connection, was cut, and was sent
    # once more on a second connection
    assert (server.requests, server.connections) == (3, 2)


def test_through_aiohttp_a_leg_cut_on_a_new_connection_is_not_sent_again():
    server = KeepAliveCloser(answer_first=False)
    assert asyncio.run(_post_twice(server)) == ["failed"] * 2
    assert (server.requests, server.connections) == (2, 2)


def test_a_pooled_connection_closed_well_after_the_request_went_out_is_not_sent_again(monkeypatch):
    # the engine read the leg and closed 0.3 s later: it may have run it, so no resend
    monkeypatch.setattr(resend, "RESEND_WINDOW_S", 0.1)
    server = KeepAliveCloser(read_then_close_after=0.3)
    assert asyncio.run(_post_twice(server)) == [200, "failed"]
    assert (server.requests, server.connections) == (2, 1)
