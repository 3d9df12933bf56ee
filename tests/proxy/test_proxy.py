"""The P/D proxy against stub engines: routing, legs, faults, bad input, admin."""

import asyncio
import hmac
import json
import time

import httpx
import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.proxy.app import create_app
from kvpath.proxy.config import TRANSFER_ID_HEADER, ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance
from kvpath.reservation.app import create_app as create_reservation_app
from kvpath.reservation.clients import HttpReserver, InProcessReserver
from kvpath.reservation.decisions import LaneInfo, ReservationService
from kvpath.reservation.wire import WorkerPair
from kvpath.testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
_ports = iter(range(18000, 18999))


def lanes():
    return [LaneInfo(i, 40000 + i, 0) for i in range(8)]


def wait_until(cond, timeout_s=10.0):
    """Poll ``cond`` until true; the bound is generous (a busy 2-core machine), never asserted."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


class EngineKeyCheck:
    """vLLM's ``--api-key`` check, as vllm/entrypoints/serve/middleware/authenticate.py
    (0.32) does it: a path under /v1 needs ``Authorization: Bearer KEY`` (else 401
    ``{"error": "Unauthorized"}``), /health and /metrics stay open. ``seen``: the
    (path, Authorization) of every request."""

    def __init__(self, app, key):
        self.app, self.key, self.seen = app, key, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            self.seen.append((scope["path"], auth))
            if scope["path"].startswith("/v1") and auth != f"Bearer {self.key}":
                from starlette.responses import JSONResponse

                return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


RES_TOKEN = "r3s-t0ken"  # the reservation service's (the proxy's admin token is another)


class Setup:
    def __init__(self, mode="push", n_p=1, n_d=1, policy="round_robin", reservation="http", token="s3cret",
                 engine_key=None, p_tp=1, **cfg):
        self.pb = [StubBehaviour() for _ in range(n_p)]
        self.db = [StubBehaviour() for _ in range(n_d)]
        self.servers = []
        self.guards = []  # with engine_key: every engine checks it, as vLLM's --api-key does
        self.p = [self._serve(self._engine(create_stub_app(f"P{i}", b), engine_key)) for i, b in enumerate(self.pb)]
        self.d = [self._serve(self._engine(create_stub_app(f"D{i}", b), engine_key)) for i, b in enumerate(self.db)]
        if engine_key:
            cfg["engine_api_key"] = engine_key
        self.svc = ReservationService(SPEC, "cc", lease_s=30)
        self.svc.register_lanes("l0h0", "l1h0", lanes(), pair=WorkerPair(p_engine="eng0", d_engine="deng0"))
        reserver = None
        if reservation == "http":
            self.res = self._serve(create_reservation_app(self.svc, token=RES_TOKEN))
            reserver = HttpReserver(self.res.url, timeout_s=0.5, token=RES_TOKEN)
        elif reservation == "inproc":
            reserver = InProcessReserver(self.svc)
        self.proxy = Proxy(
            ProxyConfig(mode=mode, policy=policy, admin_token=token, **{"first_byte_timeout_s": 3.0, **cfg}),
            # p_tp: P's TP size as the operator gave it (tp=); 0: the proxy learns it
            [Instance(s.url, "prefill", "l0h0", f"127.0.0.1:{KV_SIDE_CHANNEL_PORT + i}", f"eng{i}", tp_size=p_tp)
             for i, s in enumerate(self.p)],
            [Instance(s.url, "decode", "l1h0", engine_id=f"deng{i}") for i, s in enumerate(self.d)],
            reserver,
        )
        res_app = create_reservation_app(self.svc, token=RES_TOKEN) if reservation == "inproc" else None
        self.px = self._serve(create_app(self.proxy, res_app))
        self.url = self.px.url

    def _engine(self, app, key):
        if not key:
            return app
        self.guards.append(EngineKeyCheck(app, key))
        return self.guards[-1]

    def _serve(self, app):
        s = ServerThread(app, next(_ports)).start()
        self.servers.append(s)
        return s

    def close(self):
        for s in reversed(self.servers):
            s.stop()

    def p_legs(self, n, i=0):
        """P's records once ``n`` arrived: in the push modes D may answer before P's leg is logged."""
        assert wait_until(lambda: len(self.pb[i].received) >= n), f"P{i} got {len(self.pb[i].received)} of {n} legs"
        return self.pb[i].received

    def metrics(self):
        return httpx.get(self.url + "/metrics").text


@pytest.fixture
def setup(request):
    s = Setup(**getattr(request, "param", {}))
    yield s
    s.close()


def post(url, body, stream=False, timeout=10):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


BODY = {"model": "tiny", "prompt": "spine leaf lane path push pull", "max_tokens": 5}


def test_push_mode_sends_both_legs_with_transfer_id_lane_and_lease(setup):
    r = post(setup.url, BODY)
    assert r.status_code == 200
    direct = httpx.post(setup.d[0].url + "/v1/completions", json=BODY).json()
    assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    p_req, d_req = setup.p_legs(1)[0], setup.db[0].received[0]
    pk, dk = p_req["body"]["kv_transfer_params"]["kvpath"], d_req["body"]["kv_transfer_params"]["kvpath"]
    assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["stream"] is False
    assert pk["transfer_id"] == dk["transfer_id"] and dk["peer"] == f"127.0.0.1:{KV_SIDE_CHANNEL_PORT}"
    assert isinstance(pk["lane"], int) and pk["lease_id"].startswith("r")
    assert d_req["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    # the proxy released the reservation when the request ended
    assert setup.svc.state()["active"] == 0
    m = httpx.get(setup.url + "/metrics").text
    assert 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0' in m


def test_streaming_passthrough_is_byte_identical(setup):
    body = {**BODY, "stream": True, "max_tokens": 6}
    with httpx.stream("POST", setup.url + "/v1/completions", json=body, timeout=10) as r:
        got = b"".join(r.iter_raw())
    rid = setup.db[0].received[0]["headers"]["x-request-id"]  # the stub puts it in the chunks
    with httpx.stream("POST", setup.d[0].url + "/v1/completions", json=body, headers={"x-request-id": rid}) as r:
        direct = b"".join(r.iter_raw())
    assert got == direct and got.endswith(b"data: [DONE]\n\n")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", setup.url + "/v1/chat/completions", json=chat, timeout=10) as r:
        assert b"chat.completion.chunk" in b"".join(r.iter_raw())


@pytest.mark.parametrize("setup", [{"mode": "pull"}], indirect=True)
def test_pull_mode_is_sequential_and_forwards_p_params(setup):
    assert post(setup.url, BODY).status_code == 200
    p_req, d_req = setup.pb[0].received[0], setup.db[0].received[0]
    assert p_req["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert d_req["body"]["kv_transfer_params"]["served_by"] == "P0"  # what P returned
    assert d_req["t"] >= p_req["t"]


@pytest.mark.parametrize("setup", [{"mode": "inproc-push"}], indirect=True)
def test_inproc_push_mode_uses_one_request_id_on_both_legs(setup):
    assert post(setup.url, BODY).status_code == 200
    p_req, d_req = setup.p_legs(1)[0], setup.db[0].received[0]
    assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"]
    dk = d_req["body"]["kv_transfer_params"]
    assert dk["remote_engine_id"] == "eng0" and dk["remote_port"] == KV_SIDE_CHANNEL_PORT and dk["do_remote_prefill"] is True


@pytest.mark.parametrize("setup", [{"mode": "push"}, {"mode": "pull"}, {"mode": "inproc-push"}], indirect=True)
def test_every_answer_names_the_transfer_id_its_legs_carried(setup):
    """TRANSFER_ID_HEADER: completions and chat, streamed or not, in every mode; it is
    the X-Request-Id of both legs and, in push mode, the KV push's transfer id."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
    asks = [(path, {**body, "stream": stream})
            for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", chat)) for stream in (False, True)]
    got = []
    for path, body in asks:
        with httpx.stream("POST", setup.url + path, json=body, timeout=10) as r:
            raw = b"".join(r.iter_raw())
            assert r.status_code == 200, raw
            got.append(r.headers[TRANSFER_ID_HEADER])
    assert len(set(got)) == len(asks) and all(len(t) == 32 for t in got)
    p_legs, d_legs = setup.p_legs(len(asks)), setup.db[0].received
    assert [leg["headers"]["x-request-id"] for leg in d_legs] == got
    assert sorted(leg["headers"]["x-request-id"] for leg in p_legs) == sorted(got)  # P's answers may come late
    if setup.proxy.cfg.mode == "push":
        assert [leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in d_legs] == got
        assert sorted(leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in p_legs) == sorted(got)


def test_an_engine_error_answer_names_the_transfer_id_too(setup):
    setup.db[0].fail_status = 500
    r = post(setup.url, BODY)
    assert r.status_code == 502
    tid = setup.db[0].received[0]["headers"]["x-request-id"]
    assert r.headers[TRANSFER_ID_HEADER] == tid
    # vLLM answers a failed KV load with a bare 500: the message says where the cause is
    assert f"D's log names the cause: its request id holds the transfer id {tid}" in r.json()["error"]["message"]
    setup.db[0].fail_status = 503  # the engine's own answer to the client (busy): no such hint
    r = post(setup.url, BODY)
    assert r.status_code == 503 and "transfer id" not in r.json()["error"]["message"]
    bad = httpx.post(setup.url + "/v1/completions", json={"model": "tiny"})  # refused before any leg: no id
    assert bad.status_code == 422 and TRANSFER_ID_HEADER not in bad.headers


@pytest.mark.parametrize("setup", [{"mode": "pull", "reservation": None}], indirect=True)
def test_a_pull_mode_d_error_gets_no_push_hint(setup):
    setup.db[0].fail_status = 500  # in pull mode D reads P's blocks itself: vLLM's own connector says why
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "transfer id" not in r.json()["error"]["message"]


@pytest.mark.parametrize("setup", [{"n_p": 2, "n_d": 3}], indirect=True)
def test_round_robin_spreads_requests(setup):
    for _ in range(6):
        assert post(setup.url, BODY).status_code == 200
    setup.p_legs(3, 0), setup.p_legs(3, 1)
    assert [len(b.received) for b in setup.pb] == [3, 3]
    assert [len(b.received) for b in setup.db] == [2, 2, 2]


@pytest.mark.parametrize("setup", [{"n_d": 2, "policy": "least_outstanding"}], indirect=True)
def test_least_outstanding_avoids_the_busy_instance(setup):
    setup.db[0].delay_s = 1.5

    async def go():
        async with httpx.AsyncClient(timeout=10) as c:
            slow = asyncio.create_task(c.post(setup.url + "/v1/completions", json=BODY))
            await asyncio.sleep(0.3)
            fast = [await c.post(setup.url + "/v1/completions", json=BODY) for _ in range(4)]
            return await slow, fast

    slow, fast = asyncio.run(go())
    assert slow.status_code == 200 and all(f.status_code == 200 for f in fast)
    assert len(setup.db[0].received) == 1 and len(setup.db[1].received) == 4


MALFORMED = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 422, "model"),
    (json.dumps({"model": "tiny"}).encode(), 422, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 422, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "ten"}).encode(), 422, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": {"a": 1}}).encode(), 422, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), 422, "stream"),
]


@pytest.mark.parametrize("raw, status, field", MALFORMED)
def test_malformed_requests_get_clear_errors(setup, raw, status, field):
    r = httpx.post(setup.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"]
    if field:
        assert any(field in f for f in err["fields"])
    assert not setup.pb[0].received and not setup.db[0].received  # nothing reached the engines


def test_chat_schema_errors_name_the_field(setup):
    r = httpx.post(setup.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 422 and "messages" in r.json()["error"]["fields"][0]


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
    assert setup.svc.state()["active"] == 0  # leases of failed requests released


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
    assert setup.svc.state()["active"] == 0
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
    assert setup.svc.state()["active"] == 0


@pytest.mark.parametrize("setup", [{"reservation": "inproc"}], indirect=True)
def test_a_reservation_is_charged_to_the_routed_engines_pairs_not_to_other_engines_on_the_hosts(setup):
    # another engine pair shares the two hosts: its lanes are neither candidates nor charged
    other = WorkerPair(p_engine="other-p", d_engine="other-d")
    setup.svc.register_lanes("l0h0", "l1h0", [LaneInfo(0, 45000)], pair=other)
    charged = []
    apply = setup.svc._apply
    setup.svc._apply = lambda r, sign, now: (charged.append((sign, r.workers, len(r.paths), r.bytes)), apply(r, sign, now))
    r = httpx.post(setup.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200
    d = setup.svc.decisions[-1]
    assert d["workers"] == ("eng0/r0>deng0/r0",) and d["lane"] is not None
    # one flow, charged and then released with all the transfer's bytes
    assert charged == [(1, ("eng0/r0>deng0/r0",), 1, d["bytes"]), (-1, ("eng0/r0>deng0/r0",), 1, d["bytes"])]


def test_reservation_service_down_falls_back_and_counts(setup):
    assert post(setup.url, BODY).status_code == 200
    setup.res.stop()
    for _ in range(3):
        assert post(setup.url, BODY).status_code == 200
    lanes_sent = [r["body"]["kv_transfer_params"]["kvpath"].get("lane") for r in setup.p_legs(4)]
    assert lanes_sent[0] is not None and lanes_sent[1:] == [None, None, None]  # hash lane on P
    m = httpx.get(setup.url + "/metrics").text
    assert 'kvpath_proxy_reservation_fallbacks_total{reason="unreachable"} 3.0' in m


@pytest.mark.parametrize("setup", [{"reservation": "inproc"}], indirect=True)
def test_inproc_reservation_api_is_mounted_on_the_proxy(setup):
    """With the service in the proxy, connectors register lanes at /reservation; every
    call but /health and /metrics needs the reservation service's token (not the
    proxy's admin token: tests/kvpath/test_reservation_auth.py)."""
    url = setup.url + "/reservation/v1/lanes"
    lanes_body = {"src_host": "l0h1", "dst_host": "l1h1", "lanes": [
        {"lane": 0, "src_port": 41000}, {"lane": 1, "src_port": 41001}]}
    assert httpx.post(url, json=lanes_body).status_code == 401
    assert httpx.post(url, json=lanes_body, headers={"Authorization": "Bearer s3cret"}).status_code == 401
    h = {"Authorization": f"Bearer {RES_TOKEN}"}
    r = httpx.post(url, json=lanes_body, headers=h)
    assert r.status_code == 200, r.text
    assert httpx.post(url, json={"src_host": "l0h1"}, headers=h).status_code == 422
    assert httpx.get(setup.url + "/reservation/v1/state").status_code == 401  # the reads name agents and transfers
    st = httpx.get(setup.url + "/reservation/v1/state", headers=h).json()
    assert st["lanes_known"]["l0h1->l1h1"] == {"": [[0, 41000, 0], [1, 41001, 0]]}
    body = {"src_host": "l0h1", "dst_host": "l1h1", "bytes": 1}
    assert httpx.post(setup.url + "/reservation/v1/reserve", json=body).status_code == 401
    res = httpx.post(setup.url + "/reservation/v1/reserve", json=body, headers=h)
    assert res.status_code == 200 and res.json()["lane"] in (0, 1)
    lease = {"lease_id": res.json()["lease_id"]}
    assert httpx.post(setup.url + "/reservation/v1/release", json=lease).status_code == 401
    rel = httpx.post(setup.url + "/reservation/v1/release", json=lease, headers=h)
    assert rel.status_code == 200 and rel.json()["released"] is True
    assert httpx.get(setup.url + "/reservation/health").status_code == 200
    assert post(setup.url, BODY).status_code == 200  # l0h0 -> l1h0, lanes from the fixture
    kvp = setup.p_legs(1)[-1]["body"]["kv_transfer_params"]["kvpath"]
    assert kvp["lane"] is not None and kvp["lease_id"]


def test_admin_add_remove_requires_the_token(setup):
    extra = ServerThread(create_stub_app("D-extra"), next(_ports)).start()
    setup.servers.append(extra)
    body = {"role": "decode", "url": extra.url, "fabric_host": "l1h1"}
    assert httpx.post(setup.url + "/admin/instances", json=body).status_code == 401
    assert httpx.post(setup.url + "/admin/instances", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    h = {"Authorization": "Bearer s3cret"}
    assert httpx.post(setup.url + "/admin/instances", json={**body, "role": "chef"}, headers=h).status_code == 422
    assert httpx.post(setup.url + "/admin/instances", json={"role": "prefill", "url": extra.url}, headers=h).status_code == 422
    assert httpx.post(setup.url + "/admin/instances", json=body, headers=h).status_code == 201
    assert len(httpx.get(setup.url + "/status").json()["decode"]) == 2
    r = httpx.delete(setup.url + "/admin/instances", params={"role": "decode", "url": setup.d[0].url}, headers=h)
    assert r.status_code == 200
    assert post(setup.url, BODY).status_code == 200
    assert len(setup.db[0].received) == 0  # removed instance gets nothing
    assert httpx.delete(setup.url + "/admin/instances", params={"role": "decode", "url": "http://x:1"}, headers=h).status_code == 404


def test_models_and_health(setup):
    assert httpx.get(setup.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(setup.url + "/health").json()["status"] == "ok"


def test_no_request_is_lost_or_duplicated_under_concurrency(setup):
    async def go():
        async with httpx.AsyncClient(timeout=20) as c:
            return await asyncio.gather(*(c.post(setup.url + "/v1/completions", json={**BODY, "prompt": f"p{i} lane"})
                                          for i in range(64)))

    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(setup.pb[0].received) < 64:
        time.sleep(0.05)  # P legs finish in the background once D answered
    tids = [r["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for r in setup.db[0].received]
    assert len(tids) == 64 == len(set(tids))
    assert sorted(tids) == sorted(r["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for r in setup.pb[0].received)
    assert setup.svc.state()["active"] == 0


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
    assert setup.svc.state()["active"] == 0
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
    assert setup.svc.state()["active"] == 0
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


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
ALL_MODES = [{"mode": "push"}, {"mode": "inproc-push"}, {"mode": "pull"}]


def refused(r, field):
    """A 400 from the proxy itself, in its error shape, naming ``field``."""
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == 400 and err["fields"] == [field] and err["message"].startswith(f"{field}: ")
    assert TRANSFER_ID_HEADER.lower() not in r.headers  # refused before any leg was sent
    return err["message"]


@pytest.mark.parametrize("setup", [{"mode": "inproc-push"}], indirect=True)
def test_n_above_1_is_refused_in_inproc_push_mode(setup):
    asks = [("/v1/completions", {**BODY, "n": 2}), ("/v1/chat/completions", {**CHAT, "n": 3}),
            ("/v1/completions", {**BODY, "n": 2, "stream": True})]
    for path, body in asks:
        msg = refused(httpx.post(setup.url + path, json=body, timeout=10), "n")
        assert "separate requests" in msg
    assert not setup.db[0].received and not setup.pb[0].received
    assert 'kvpath_proxy_errors_total{kind="unsupported"} 3.0' in setup.metrics()
    assert post(setup.url, {**BODY, "n": 1}).status_code == 200


def test_n_above_1_is_served_in_push_mode_with_one_prefill_and_one_push(setup):
    """D's child requests share one push: P's leg computes one prefill (n 1, no
    best_of), D's leg keeps the client's n."""
    for path, body in (("/v1/completions", {**BODY, "n": 2, "best_of": 1}),
                       ("/v1/chat/completions", {**CHAT, "n": 3}),
                       ("/v1/completions", {**BODY, "n": 4, "stream": True})):
        r = httpx.post(setup.url + path, json=body, timeout=10)
        assert r.status_code == 200, r.text
    p_legs, d_legs = setup.p_legs(3), setup.db[0].received
    assert [leg["body"]["n"] for leg in p_legs] == [1, 1, 1]
    assert [leg["body"]["n"] for leg in d_legs] == [2, 3, 4]
    assert all("best_of" not in leg["body"] for leg in p_legs) and d_legs[0]["body"]["best_of"] == 1
    # one push per request: both legs of each carry the same one transfer id
    assert [leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in p_legs] == \
        [leg["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] for leg in d_legs]


@pytest.mark.parametrize("setup", [{"mode": "pull"}], indirect=True)
def test_pull_mode_passes_n_on(setup):
    assert post(setup.url, {**BODY, "n": 2}).status_code == 200
    assert setup.pb[0].received[0]["body"]["n"] == 2 and setup.db[0].received[0]["body"]["n"] == 2


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_n_must_be_an_integer_in_range_never_a_string(setup):
    """vLLM's pydantic takes "2" for 2: passed on as a string, it would slip past every
    check of n and fan out on the engines."""
    for bad in ("2", "1", 2.0, 0, -1, 129, True, [2], {"n": 2}):
        for path, body in (("/v1/completions", {**BODY, "n": bad}), ("/v1/chat/completions", {**CHAT, "n": bad})):
            msg = refused(httpx.post(setup.url + path, json=body, timeout=10), "n")
            assert "integer from 1 to 128" in msg
    assert "the string '2'" in refused(post(setup.url, {**BODY, "n": "2"}), "n")
    assert not setup.db[0].received and not setup.pb[0].received
    assert post(setup.url, {**BODY, "n": None}).status_code == 200


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_best_of_above_1_or_not_an_integer_is_refused_in_every_mode(setup):
    """vLLM 0.32's completions request has no best_of (it takes the field and ignores
    it), so best_of 2 would silently not be the best of 2."""
    assert "vLLM ignores best_of" in refused(post(setup.url, {**BODY, "best_of": 2}), "best_of")
    for bad in ("3", "1", 1.0, 0, True):
        refused(post(setup.url, {**BODY, "best_of": bad}), "best_of")
    refused(httpx.post(setup.url + "/v1/chat/completions", json={**CHAT, "best_of": 2}, timeout=10), "best_of")
    assert not setup.db[0].received and not setup.pb[0].received
    assert post(setup.url, {**BODY, "best_of": 1}).status_code == 200
    assert post(setup.url, {**BODY, "best_of": None}).status_code == 200


@pytest.mark.parametrize("setup", ALL_MODES, indirect=True)
def test_a_batch_of_prompts_is_refused_in_the_push_modes(setup):
    """vLLM makes one request per prompt of a batch, all with the leg's one
    kv_transfer_params: one push cannot serve them. A batch of one is one prompt."""
    mode = setup.proxy.cfg.mode
    batches = [["spine leaf", "lane path"], [[1, 2, 3], [4, 5, 6]], ["a", "b", "c"]]
    for prompt in batches:
        r = post(setup.url, {**BODY, "prompt": prompt})
        if mode == "pull":
            assert r.status_code == 200, r.text
        else:
            assert "batch of" in refused(r, "prompt")
    if mode != "pull":
        assert not setup.db[0].received and not setup.pb[0].received
    for one in (["spine leaf"], [[1, 2, 3]], [1, 2, 3]):
        assert post(setup.url, {**BODY, "prompt": one}).status_code == 200


ENGINE_KEY = "ek-7Qx2-engine-key"


@pytest.mark.parametrize("setup", [{"mode": m, "engine_key": ENGINE_KEY} for m in ("push", "inproc-push", "pull")],
                         indirect=True)
def test_both_legs_carry_the_engine_key_never_the_clients(setup):
    """Engines run with vLLM's --api-key: the proxy's own key goes on both legs and on
    GET /v1/models; a client's Authorization (a key for the proxy, or a guess) is never
    forwarded in its place. Health probes need none (vLLM leaves /health open)."""
    for client_auth in (None, "Bearer client-key", f"Bearer {ENGINE_KEY}-not"):
        hdr = {"Authorization": client_auth} if client_auth else {}
        r = httpx.post(setup.url + "/v1/completions", json=BODY, headers=hdr, timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.post(setup.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=hdr, timeout=10)
        assert r.status_code == 200 and b"chat.completion.chunk" in r.content
    legs = setup.p_legs(6) + setup.db[0].received
    assert len(legs) == 12 and all(leg["headers"]["authorization"] == f"Bearer {ENGINE_KEY}" for leg in legs)
    r = httpx.get(setup.url + "/v1/models", headers={"Authorization": "Bearer client-key"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    seen = [auth for g in setup.guards for path, auth in g.seen if path.startswith("/v1")]
    assert seen and set(seen) == {f"Bearer {ENGINE_KEY}"}
    # the key is not part of what /status or the config's repr show
    assert ENGINE_KEY not in httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).text
    assert ENGINE_KEY not in repr(setup.proxy.cfg)


@pytest.mark.parametrize("setup", [{"engine_key": ENGINE_KEY}], indirect=True)
def test_without_the_engine_key_engines_refuse_the_legs(setup):
    """The stubs' check is what vLLM does with --api-key: a proxy without the key gets
    401 from them (502 to the client), so the test above checks something real."""
    assert httpx.post(setup.d[0].url + "/v1/completions", json=BODY).status_code == 401
    assert httpx.get(setup.d[0].url + "/health").status_code == 200  # open, as in vLLM
    setup.proxy.engine_headers = {}
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "refused the proxy's engine API key (401" in r.json()["error"]["message"]
    assert 'kvpath_proxy_errors_total{kind="upstream_auth"}' in setup.metrics()


def _garbling_engine():
    """A TCP server that answers every request with a malformed status line: aiohttp
    then raises a ClientResponseError, whose repr holds the request's headers."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve():
        while True:
            try:
                c, _ = sock.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 20x OK\r\nContent-Length: 2\r\n\r\nhi")

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("setup", [{"engine_key": ENGINE_KEY, "health_interval_s": 0}], indirect=True)
def test_an_engines_malformed_answer_never_shows_the_engine_key(setup, caplog):
    sock, bad = _garbling_engine()
    try:
        setup.proxy.pools["decode"].add(Instance(bad, "decode", "l1h0", engine_id="deng0"))
        setup.proxy.pools["decode"].remove(setup.d[0].url)
        for body in (BODY, {**BODY, "stream": True}):
            r = post(setup.url, body)
            assert r.status_code == 502 and "ClientResponseError" in r.text and "20x" in r.text
            assert ENGINE_KEY not in r.text
        assert httpx.get(setup.url + "/v1/models").status_code == 502
        assert ENGINE_KEY not in caplog.text and "ClientResponseError" in caplog.text
    finally:
        sock.close()


def test_engine_api_key_must_be_one_printable_line():
    for bad in ("", "two\nlines", "tab\tkey", "caf\u00e9"):
        with pytest.raises(ValueError, match="engine API key"):
            Proxy(ProxyConfig(engine_api_key=bad), [], [])


def test_status_shows_engine_addresses_only_with_the_admin_token(setup):
    assert post(setup.url, BODY).status_code == 200
    private = ("url", "kv_addr", "fabric_host", "engine_id")
    public = httpx.get(setup.url + "/status")
    assert public.status_code == 200
    st = public.json()
    assert st["redacted"] is True and st["mode"] == "push"
    for role in ("prefill", "decode"):
        (inst,) = st[role]
        assert not set(private) & set(inst)
        assert inst["index"] == 0 and inst["healthy"] is True and inst["served"] >= 1 and inst["errors"] == 0
    for where in (setup.p[0].url, setup.d[0].url, "127.0.0.1:", "l0h0", "eng0", "deng0"):
        assert where.split("//")[-1] not in public.text, where
    full = httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).json()
    assert full["redacted"] is False
    assert full["prefill"][0]["url"] == setup.p[0].url and full["decode"][0]["url"] == setup.d[0].url
    assert full["prefill"][0]["kv_addr"].startswith("127.0.0.1:") and full["prefill"][0]["engine_id"] == "eng0"
    wrong = httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3creT"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401 and setup.p[0].url not in wrong.text


@pytest.mark.parametrize("setup", [{"token": None}], indirect=True)
def test_status_without_an_admin_token_configured_never_shows_addresses(setup):
    assert setup.d[0].url not in httpx.get(setup.url + "/status").text
    assert httpx.get(setup.url + "/status", headers={"Authorization": "Bearer s3cret"}).status_code == 401


def test_admin_token_is_compared_in_constant_time(setup, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    body = {"role": "decode", "url": "http://127.0.0.1:9", "fabric_host": "l1h1"}
    r = httpx.post(setup.url + "/admin/instances", json=body, headers={"Authorization": "Bearer s3creT"})
    assert r.status_code == 401
    assert calls == [(b"Bearer s3creT", b"Bearer s3cret")]


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


def test_push_legs_carry_one_fresh_transfer_key_each():
    from kvpath.proxy import legs
    from kvpath.proxy.instances import Instance

    p = Instance("http://p:1", "prefill", kv_addr="10.0.0.1:5600")
    (pb, db), (pb2, _) = (legs.push_legs({"prompt": "x"}, p, "t1", None, None) for _ in range(2))
    key = pb["kv_transfer_params"]["kvpath"]["transfer_key"]
    assert len(key) >= 16 and db["kv_transfer_params"]["kvpath"]["transfer_key"] == key
    assert pb2["kv_transfer_params"]["kvpath"]["transfer_key"] != key


def test_a_p_instances_tp_size_reaches_ds_leg_and_bad_values_name_the_field():
    from kvpath.connector.params import parse_decode
    from kvpath.proxy import legs
    from kvpath.proxy.cli import parse_instance

    p = parse_instance("http://p:1,kv_addr=10.0.0.1:5600,tp=2", "prefill")
    assert p.tp_size == 2 and p.to_dict()["tp_size"] == 2
    _, db = legs.push_legs({"prompt": "x"}, p, "t1", None, None)
    assert parse_decode(db["kv_transfer_params"]).tp_size == 2
    # not given: not sent, and D takes P's TP size to be its own
    _, db = legs.push_legs({"prompt": "x"}, parse_instance("http://p:1,kv_addr=10.0.0.1:5600", "prefill"), "t2",
                           None, None)
    assert "tp_size" not in db["kv_transfer_params"]["kvpath"] and parse_decode(db["kv_transfer_params"]).tp_size == 0
    for bad in ("0", "x", "2000", ""):
        with pytest.raises(SystemExit, match=f"tp must be the engine's TP size, 1 to 1024, got '{bad}'"):
            parse_instance(f"http://p:1,kv_addr=h:1,tp={bad}", "prefill")


@pytest.mark.parametrize("setup", [{"p_tp": 0}], indirect=True)
def test_the_proxy_learns_ps_tp_size_from_ps_answer_and_then_sends_both_legs_at_once(setup):
    setup.pb[0].tp_size = 2
    setup.pb[0].delay_s = 1.0  # P answers late: a D leg sent at once arrives before it
    assert post(setup.url, BODY).status_code == 200
    p1, d1 = setup.p_legs(1)[0], setup.db[0].received[0]
    # unknown TP size: P's leg first, D's only after P's answer, naming what P said
    assert d1["t"] >= p1["t"] + 1.0
    assert d1["body"]["kv_transfer_params"]["kvpath"]["tp_size"] == 2
    st = setup.proxy.pools["prefill"].all()[0].to_dict()
    assert st["tp_size"] == 2 and st["tp_source"] == "learned"
    assert post(setup.url, BODY).status_code == 200
    p2, d2 = setup.p_legs(2)[1], setup.db[0].received[1]
    assert d2["t"] < p2["t"] + 0.5  # learned: both legs at once
    assert d2["body"]["kv_transfer_params"]["kvpath"]["tp_size"] == 2


@pytest.mark.parametrize("setup", [{"p_tp": 1}], indirect=True)
def test_ps_own_tp_size_replaces_a_wrong_one_the_operator_gave(setup):
    setup.pb[0].tp_size = 2
    assert post(setup.url, BODY).status_code == 200  # D's leg still names the given 1
    assert setup.db[0].received[0]["body"]["kv_transfer_params"]["kvpath"].get("tp_size") == 1
    assert wait_until(lambda: setup.proxy.pools["prefill"].all()[0].tp_size == 2)
    assert post(setup.url, BODY).status_code == 200
    assert setup.db[0].received[1]["body"]["kv_transfer_params"]["kvpath"]["tp_size"] == 2
