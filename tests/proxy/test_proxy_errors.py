"""The P/D proxy against stub engines when something fails: engine errors, timeouts,
clients that leave, broken and stalled streams, busy engines, health checks."""

import asyncio
import json
import time

import httpx
import pytest

from tests.proxy.proxy_stubs import BODY, post, wait_until


def test_upstream_error_is_502_with_its_message_and_proxy_stays_up(setup):
    setup.pb[0].fail_status = 500
    setup.db[0].delay_s = 1.0  # like a real D, it waits for the push that a failed P never sends
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "P0 failed on purpose" in r.json()["error"]["message"]
    # the D leg was cancelled, not left waiting (or never sent, when P failed first)
    assert wait_until(lambda: setup.db[0].cancelled == len(setup.db[0].received) <= 1, 3.0), setup.db[0]
    setup.pb[0].fail_status = 0
    setup.db[0].delay_s = 0
    setup.db[0].fail_status = 500
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "D0 failed on purpose" in r.json()["error"]["message"]
    setup.db[0].fail_status = 0
    assert post(setup.url, BODY).status_code == 200
    assert 'kvpath_proxy_errors_total{kind="upstream_error"} 2.0' in httpx.get(setup.url + "/metrics").text
    assert wait_until(lambda: setup.svc.state()["active"] == 0)  # leases of failed requests released


def test_a_p_leg_answered_with_a_role_error_fails_the_request_and_cancels_d(setup):
    # a P pool entry that is really a kv_consumer answers 200 with kv_transfer_params.error
    setup.pb[0].kv_error = "do_remote_decode sent to an engine whose kv_role is kv_consumer"
    setup.db[0].delay_s = 2.0  # like a real D, it waits for the push that never comes
    r = post(setup.url, BODY)
    assert r.status_code == 502, r.text
    assert "did not serve the leg" in r.json()["error"]["message"] and "kv_consumer" in r.json()["error"]["message"]
    # the D leg was cancelled, not left waiting (or never sent, when P's answer came first)
    assert wait_until(lambda: setup.db[0].cancelled == len(setup.db[0].received) <= 1), setup.db[0]
    assert wait_until(lambda: setup.svc.state()["active"] == 0)  # its lease released
    setup.pb[0].kv_error = ""
    setup.db[0].delay_s = 0
    assert post(setup.url, BODY).status_code == 200
    # a D that is really a kv_producer computes the answer itself: passed on, counted
    setup.db[0].kv_error = "do_remote_prefill sent to an engine whose kv_role is kv_producer"
    r = post(setup.url, BODY)
    assert r.status_code == 200 and "kv_producer" in r.json()["kv_transfer_params"]["error"]
    assert httpx.get(setup.url + "/status").json()["decode"][0]["errors"] == 1


@pytest.mark.parametrize("setup", [{"mode": "push"}, {"mode": "pull"}], indirect=True)
def test_a_p_answer_that_is_not_a_json_object_is_502(setup):
    setup.pb[0].raw_answer = b"[]"
    # in push mode the legs run side by side; like a real D, this one waits for the push that a bad P
    # never sends, so P's answer is judged first (a D that answered first is passed on, by design)
    setup.db[0].delay_s = 2.0
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "not an object" in r.json()["error"]["message"]
    setup.pb[0].raw_answer = None
    setup.db[0].delay_s = 0
    assert post(setup.url, BODY).status_code == 200


@pytest.mark.parametrize("setup", [{"mode": "push"}, {"mode": "pull"}], indirect=True)
def test_min_tokens_goes_to_the_decode_leg_only(setup):
    r = post(setup.url, {**BODY, "min_tokens": 4})
    assert r.status_code == 200, r.text
    p_body = setup.p_legs(1)[0]["body"]
    assert p_body["max_tokens"] == 1 and "min_tokens" not in p_body
    assert setup.db[0].received[0]["body"]["min_tokens"] == 4


def test_p_stays_in_flight_until_its_leg_ends_after_d_answered(setup):
    setup.pb[0].delay_s = 3.0  # P's answer comes well after D's
    r = post(setup.url, BODY)
    assert r.status_code == 200
    status = httpx.get(setup.url + "/status").json()
    assert status["decode"][0]["inflight"] == 0
    assert status["prefill"][0]["inflight"] == 1  # least_outstanding must see P busy
    assert wait_until(lambda: httpx.get(setup.url + "/status").json()["prefill"][0]["inflight"] == 0)


def test_upstream_timeout_is_504(setup):
    setup.db[0].hang = True
    t0 = time.monotonic()
    r = post(setup.url, BODY)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 6


@pytest.mark.parametrize("raw,message", [
    (b'{"model": "tiny", "prompt": "x"', "not valid JSON"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "not valid JSON"),  # invalid UTF-8 inside a string
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "not valid JSON"),  # strict JSON (RFC 8259)
    (b'["tiny", "x"]', "must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_why_and_reaches_no_engine(setup, raw, message):
    r = httpx.post(setup.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert not setup.pb[0].received and not setup.db[0].received
    assert 'kvpath_proxy_errors_total{kind="bad_json"} 1.0' in httpx.get(setup.url + "/metrics").text


def test_a_bug_inside_the_proxy_is_a_500_with_a_message_not_a_dropped_connection(setup, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(setup.proxy, "_run", broken)
    r = post(setup.url, BODY)
    assert r.status_code == 500 and "internal proxy error" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert post(setup.url, BODY).status_code == 200


def test_killed_engine_gives_502_and_proxy_keeps_serving(setup):
    setup.d[0].stop()
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    # clients never learn where the engines listen (the proxy's log names them)
    assert "decode #0" in r.text and setup.d[0].url.split("//")[-1] not in r.text
    assert httpx.get(setup.url + "/health").status_code == 200


def test_client_disconnect_cancels_both_legs_and_releases_the_lease(setup):
    setup.pb[0].hang = True
    setup.db[0].hang = True
    with pytest.raises(httpx.TimeoutException):
        post(setup.url, BODY, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (setup.pb[0].cancelled < 1 or setup.db[0].cancelled < 1):
        time.sleep(0.05)
    assert setup.pb[0].cancelled == 1 and setup.db[0].cancelled == 1
    assert wait_until(lambda: setup.svc.state()["active"] == 0)
    assert 'kvpath_proxy_errors_total{kind="client_disconnect"} 1.0' in httpx.get(setup.url + "/metrics").text


def test_client_leaving_mid_stream_cancels_the_decode_stream(setup):
    setup.db[0].token_delay_s = 0.2
    body = {**BODY, "stream": True, "max_tokens": 50}
    with httpx.stream("POST", setup.url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # one chunk, then hang up
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and setup.db[0].stream_cancelled < 1:
        time.sleep(0.05)
    assert setup.db[0].stream_cancelled == 1  # D's stream was dropped, not read to the end
    m = httpx.get(setup.url + "/metrics").text
    assert 'kvpath_proxy_errors_total{kind="client_disconnect"} 1.0' in m
    assert all(i["inflight"] == 0 for i in httpx.get(setup.url + "/status").json()["decode"])
    assert wait_until(lambda: setup.svc.state()["active"] == 0)


# ---- faults: timeouts, broken streams, busy engines, health, unsupported requests ----

STREAM = {**BODY, "stream": True}


def stream_body(url, body, path="/v1/completions"):
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        return r.status_code, b"".join(r.iter_raw())


def events(raw: bytes) -> list[str]:
    """The data of each SSE event; every event must be whole (end in a blank line)."""
    assert raw.endswith(b"\n\n")
    out = []
    for ev in raw.decode().split("\n\n")[:-1]:
        assert ev.startswith("data: "), ev
        out.append(ev[len("data: "):])
    return out


@pytest.mark.parametrize("setup", [{"first_byte_timeout_s": 1.5, "chunk_gap_timeout_s": 2.0}], indirect=True)
def test_a_stream_longer_than_the_first_byte_timeout_completes(setup):
    """The old total timeout cut any stream longer than it; now only the first byte
    and the gaps between chunks are bounded."""
    setup.db[0].token_delay_s = 0.1  # 30 tokens: about 3 s in all, at least twice the first-byte bound
    status, raw = stream_body(setup.url, {**STREAM, "max_tokens": 30})
    evs = events(raw)
    assert status == 200 and len(evs) == 31 and evs[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in evs[:-1])
    assert 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0' in setup.metrics()


@pytest.mark.parametrize("setup", [{"chunk_gap_timeout_s": 1.0}], indirect=True)
def test_a_stalled_stream_ends_with_an_error_event(setup):
    setup.db[0].stall_after = 3
    status, raw = stream_body(setup.url, {**STREAM, "max_tokens": 10})
    evs = events(raw)
    assert status == 200 and len(evs) == 5 and evs[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["index"] for e in evs[:3]] == [0, 0, 0]
    err = json.loads(evs[3])["error"]
    assert err["code"] == 504 and err["type"] == "GatewayTimeoutError" and err["param"] is None
    # the engine is named by role and index, as /status shows it without the admin token
    assert "stalled" in err["message"] and "decode #0" in err["message"]
    assert setup.d[0].url.split("//")[-1] not in err["message"]
    m = setup.metrics()
    assert 'kvpath_proxy_errors_total{kind="upstream_stream_error"} 1.0' in m
    assert 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="504"} 1.0' in m
    assert wait_until(lambda: setup.db[0].stream_cancelled == 1)  # D's stalled stream was dropped
    assert wait_until(lambda: setup.svc.state()["active"] == 0)
    assert all(i["inflight"] == 0 for i in httpx.get(setup.url + "/status").json()["decode"])


def test_a_broken_stream_ends_with_an_error_event_and_no_half_event(setup):
    setup.db[0].break_after = 3  # three events, half of a fourth, then the connection drops
    status, raw = stream_body(setup.url, {**STREAM, "max_tokens": 10})
    assert b"half an ev" not in raw  # the half event never reached the client
    evs = events(raw)
    assert status == 200 and len(evs) == 5
    assert all("choices" in json.loads(e) for e in evs[:3])
    assert json.loads(evs[3]) == {"error": {"message": json.loads(evs[3])["error"]["message"],
                                            "type": "BadGatewayError", "param": None, "code": 502}}
    assert "stream broke" in json.loads(evs[3])["error"]["message"]
    assert raw.endswith(b"data: [DONE]\n\n")
    m = setup.metrics()
    assert 'kvpath_proxy_errors_total{kind="upstream_stream_error"} 1.0' in m
    assert 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="502"} 1.0' in m
    assert wait_until(lambda: setup.svc.state()["active"] == 0)
    # the same request on a healthy stream still passes through unchanged
    setup.db[0].break_after = -1
    status, raw = stream_body(setup.url, {**STREAM, "max_tokens": 10})
    assert status == 200 and len(events(raw)) == 11 and b"error" not in raw


def test_engine_429_and_503_reach_the_client_with_retry_after(setup):
    """From P's leg or D's, streamed or not: the engine's status and Retry-After, not 502."""
    cases = [(leg, stream, code, retry) for leg in ("prefill", "decode") for stream in (False, True)
             for code, retry in ((429, "7"), (503, None))]
    for leg, stream, code, retry in cases:
        b = setup.pb[0] if leg == "prefill" else setup.db[0]
        b.fail_status, b.retry_after = code, retry
        setup.db[0].delay_s = 1.0 if leg == "prefill" else 0.0  # a real D waits for P's push
        r = post(setup.url, {**BODY, "stream": stream})
        case = (leg, stream, code)
        assert r.status_code == code, case
        assert r.headers.get("retry-after") == retry, case
        assert "failed on purpose" in r.json()["error"]["message"], case
        b.fail_status, b.retry_after = 0, None
    setup.db[0].delay_s = 0.0
    assert post(setup.url, BODY).status_code == 200
    assert 'kvpath_proxy_errors_total{kind="upstream_busy"} 8.0' in setup.metrics()


@pytest.mark.parametrize("setup", [{"n_d": 2, "health_interval_s": 0.1}], indirect=True)
def test_an_instance_failing_health_checks_leaves_rotation_and_rejoins(setup):
    def healthy():
        return [i["healthy"] for i in httpx.get(setup.url + "/status").json()["decode"]]

    assert healthy() == [True, True] and 'kvpath_proxy_healthy_instances{role="decode"} 2.0' in setup.metrics()
    setup.db[0].healthy = False
    assert wait_until(lambda: healthy() == [False, True])
    assert 'kvpath_proxy_healthy_instances{role="decode"} 1.0' in setup.metrics()
    for _ in range(4):
        assert post(setup.url, BODY).status_code == 200
    assert [len(b.received) for b in setup.db] == [0, 4]  # all went to the healthy one
    setup.db[0].healthy = True
    assert wait_until(lambda: healthy() == [True, True])
    assert 'kvpath_proxy_healthy_instances{role="decode"} 2.0' in setup.metrics()
    for _ in range(4):
        assert post(setup.url, BODY).status_code == 200
    assert [len(b.received) for b in setup.db] == [2, 6]  # back in the round robin


@pytest.mark.parametrize("setup", [{"health_interval_s": 0.1}], indirect=True)
def test_every_instance_of_a_role_unhealthy_is_503_naming_the_role(setup):
    setup.db[0].healthy = False
    assert wait_until(lambda: not httpx.get(setup.url + "/status").json()["decode"][0]["healthy"])
    r = post(setup.url, BODY)
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "decode" in msg and "unhealthy" in msg
    assert not setup.db[0].received and not setup.pb[0].received  # nothing was sent
    assert 'kvpath_proxy_healthy_instances{role="prefill"} 1.0' in setup.metrics()
    setup.db[0].healthy = True
    assert wait_until(lambda: httpx.get(setup.url + "/status").json()["decode"][0]["healthy"])
    assert post(setup.url, BODY).status_code == 200


@pytest.mark.parametrize("setup", [{"n_d": 2, "health_interval_s": 3600, "unhealthy_after": 2}], indirect=True)
def test_a_dead_instance_leaves_rotation_after_failed_legs(setup):
    """No probe runs here (an hour apart): refused connections on legs count as
    failed probes, so the dead D is out after its second failed request."""
    setup.d[0].stop()
    codes = [post(setup.url, BODY).status_code for _ in range(6)]
    assert codes == [502, 200, 502, 200, 200, 200]
    dec = httpx.get(setup.url + "/status").json()["decode"]
    assert [i["healthy"] for i in dec] == [False, True] and dec[0]["health_failures"] == 2
    assert 'kvpath_proxy_healthy_instances{role="decode"} 1.0' in setup.metrics()


def test_upstream_timeout_s_is_a_deprecated_alias_of_first_byte_timeout_s(monkeypatch):
    import uvicorn

    from kvpath.cli import main

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    base = ["proxy", "--prefill", "http://127.0.0.1:1,kv_addr=127.0.0.1:2", "--decode", "http://127.0.0.1:3"]
    assert main(base + ["--upstream-timeout-s", "7", "--chunk-gap-timeout-s", "9", "--health-interval-s", "0",
                        "--unhealthy-after", "3"]) == 0
    assert main(base) == 0
    cfg, default = apps[0].proxy.cfg, apps[1].proxy.cfg
    got = (cfg.first_byte_timeout_s, cfg.chunk_gap_timeout_s, cfg.health_interval_s, cfg.unhealthy_after)
    assert got == (7, 9, 0, 3)
    assert (default.first_byte_timeout_s, default.chunk_gap_timeout_s, default.health_interval_s,
            default.unhealthy_after) == (300, 60, 2, 2)


def test_event_framer_passes_whole_events_only_and_is_lossless():
    from kvpath.proxy.stream_guard import EventFramer

    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):  # every split of the stream into two chunks
        f = EventFramer()
        outs = [f.feed(stream[:cut]), f.feed(stream[cut:]), f.flush()]
        assert b"".join(outs) == stream
        assert all(o == b"" or o.endswith(b"\n\n") for o in outs[:2])
    f = EventFramer()
    assert f.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'  # the half event is held


def test_gap_watch_counts_only_time_spent_waiting_on_d():
    from kvpath.proxy.stream_guard import ChunkGapTimeout, GapWatch

    class Reader:
        exc = None

        def set_exception(self, exc):
            self.exc = exc

    async def go():
        r = Reader()
        w = GapWatch(r, 0.05, "decode http://d")
        await asyncio.sleep(0.3)  # not reading (sending to a slow client): no stall
        assert r.exc is None
        w.reading()
        for _ in range(200):
            if r.exc is not None:
                break
            await asyncio.sleep(0.05)
        w.cancel()
        return r.exc

    exc = asyncio.run(go())
    assert isinstance(exc, ChunkGapTimeout) and "stalled" in str(exc)


def test_a_relay_whose_stream_never_started_still_releases_everything():
    # the client leaves while the response starts: closing a generator that never
    # ran skips its `finally`, so the relay's own clean-up must run instead
    from kvpath.proxy.relay import RelayResponse

    ran: list[str] = []

    def relay():
        async def gen():
            try:
                yield b"data: x\n\n"
            finally:
                ran.append("relay finally")
        return gen()

    async def cleanup():
        ran.append("cleanup")

    async def never(*_):
        await asyncio.sleep(60)

    async def fails(msg):
        raise OSError("client gone")

    async def swallows(msg):
        pass

    async def go():
        with pytest.raises(OSError):
            await RelayResponse(relay(), 200, "text/event-stream", on_unstarted=cleanup)({"type": "http"}, never, fails)
        assert ran == ["cleanup"]
        ran.clear()
        await RelayResponse(relay(), 200, "text/event-stream", on_unstarted=cleanup)({"type": "http"}, never, swallows)
        assert ran == ["relay finally"]  # a relay that ran cleans up by itself, once

    asyncio.run(go())
