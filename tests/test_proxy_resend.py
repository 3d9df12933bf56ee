"""A leg whose pooled connection the engine had closed is sent again (the engine never
saw it); anything else is not, and the pool lets idle connections go before the engine does."""

import asyncio

import aiohttp
import pytest

from kvpath.proxy import core
from kvpath.proxy.config import ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance


class FlakySession:
    def __init__(self, failures: list[Exception]):
        self.failures, self.calls = list(failures), 0

    async def post(self, url, **kw):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "answer"


def proxy_with(session) -> Proxy:
    px = Proxy(ProxyConfig(), [Instance("http://p", "prefill", kv_addr="127.0.0.1:1")], [Instance("http://d", "decode")])
    px.session = session
    return px


def closed() -> aiohttp.ClientOSError:
    return aiohttp.ClientOSError(None, "Can not write request body for http://d/v1/completions")


def test_a_leg_is_sent_again_while_its_pooled_connections_turn_out_closed():
    s = FlakySession([closed(), closed()])  # two of a burst's pooled connections were closed
    assert asyncio.run(proxy_with(s)._post("http://d/v1/completions", {}, {})) == "answer"
    assert s.calls == 3


def test_it_gives_up_after_three_tries_and_never_resends_other_errors():
    s = FlakySession([closed()] * core.POST_ATTEMPTS)
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(proxy_with(s)._post("http://d/v1/completions", {}, {}))
    assert s.calls == core.POST_ATTEMPTS
    s = FlakySession([aiohttp.ClientOSError(None, "Connection reset by peer")])  # the engine may have seen it
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(proxy_with(s)._post("http://d/v1/completions", {}, {}))
    assert s.calls == 1


def test_idle_pooled_connections_are_dropped_before_the_engines_keep_alive_ends():
    async def go():
        px = proxy_with(None)
        await px.start()
        try:
            return px.session.connector._keepalive_timeout
        finally:
            await px.stop()

    assert asyncio.run(go()) == core.IDLE_KEEPALIVE_S < 5.0  # uvicorn's default keep-alive timeout



def test_the_proxy_keeps_its_clients_idle_connections_longer_than_their_pools_do():
    from kvpath.proxy import cli

    assert cli.CLIENT_KEEPALIVE_S > 15  # httpx keeps an idle connection 5 s, aiohttp 15 s
