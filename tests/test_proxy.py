"""The P/D proxy against stub engines: routing, legs, faults, bad input, admin."""

import asyncio
import json
import time

import httpx
import pytest

from kvpath.fabric import FabricSpec
from proxy.app import Proxy, ProxyConfig, create_app
from proxy.instances import Instance
from proxy.reservation import LaneInfo, ReservationService
from proxy.reservation_app import create_app as create_reservation_app
from proxy.reservation_client import HttpReserver, InProcessReserver
from testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
_ports = iter(range(18000, 18999))


def lanes():
    return [LaneInfo(i, 40000 + i, 0) for i in range(8)]


class Setup:
    def __init__(self, mode="push", n_p=1, n_d=1, policy="round_robin", reservation="http", token="s3cret"):
        self.pb = [StubBehaviour() for _ in range(n_p)]
        self.db = [StubBehaviour() for _ in range(n_d)]
        self.servers = []
        self.p = [self._serve(create_stub_app(f"P{i}", b)) for i, b in enumerate(self.pb)]
        self.d = [self._serve(create_stub_app(f"D{i}", b)) for i, b in enumerate(self.db)]
        self.svc = ReservationService(SPEC, "cc", lease_s=30)
        self.svc.register_lanes("l0h0", "l1h0", lanes())
        reserver = None
        if reservation == "http":
            self.res = self._serve(create_reservation_app(self.svc))
            reserver = HttpReserver(self.res.url, timeout_s=0.5)
        elif reservation == "inproc":
            reserver = InProcessReserver(self.svc)
        self.proxy = Proxy(
            ProxyConfig(mode=mode, policy=policy, admin_token=token, upstream_timeout_s=3.0),
            [Instance(s.url, "prefill", "l0h0", f"127.0.0.1:{5600 + i}", f"eng{i}") for i, s in enumerate(self.p)],
            [Instance(s.url, "decode", "l1h0") for s in self.d],
            reserver,
        )
        self.px = self._serve(create_app(self.proxy, create_reservation_app(self.svc) if reservation == "inproc" else None))
        self.url = self.px.url

    def _serve(self, app):
        s = ServerThread(app, next(_ports)).start()
        self.servers.append(s)
        return s

    def close(self):
        for s in reversed(self.servers):
            s.stop()


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
    p_req, d_req = setup.pb[0].received[0], setup.db[0].received[0]
    pk, dk = p_req["body"]["kv_transfer_params"]["kvpath"], d_req["body"]["kv_transfer_params"]["kvpath"]
    assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["stream"] is False
    assert pk["transfer_id"] == dk["transfer_id"] and dk["peer"] == "127.0.0.1:5600"
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
    p_req, d_req = setup.pb[0].received[0], setup.db[0].received[0]
    assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"]
    dk = d_req["body"]["kv_transfer_params"]
    assert dk["remote_engine_id"] == "eng0" and dk["remote_port"] == 5600 and dk["do_remote_prefill"] is True


@pytest.mark.parametrize("setup", [{"n_p": 2, "n_d": 3}], indirect=True)
def test_round_robin_spreads_requests(setup):
    for _ in range(6):
        assert post(setup.url, BODY).status_code == 200
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
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and setup.db[0].cancelled < 1:
        time.sleep(0.05)
    assert setup.db[0].cancelled == 1  # the D leg was cancelled, not left waiting
    setup.pb[0].fail_status = 0
    setup.db[0].delay_s = 0
    setup.db[0].fail_status = 503
    r = post(setup.url, BODY)
    assert r.status_code == 502 and "D0 failed on purpose" in r.json()["error"]["message"]
    setup.db[0].fail_status = 0
    assert post(setup.url, BODY).status_code == 200
    assert 'kvpath_proxy_errors_total{kind="upstream_error"} 2.0' in httpx.get(setup.url + "/metrics").text
    assert setup.svc.state()["active"] == 0  # leases of failed requests released


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


def test_reservation_service_down_falls_back_and_counts(setup):
    assert post(setup.url, BODY).status_code == 200
    setup.res.stop()
    for _ in range(3):
        assert post(setup.url, BODY).status_code == 200
    lanes_sent = [r["body"]["kv_transfer_params"]["kvpath"].get("lane") for r in setup.pb[0].received]
    assert lanes_sent[0] is not None and lanes_sent[1:] == [None, None, None]  # hash lane on P
    m = httpx.get(setup.url + "/metrics").text
    assert 'kvpath_proxy_reservation_fallbacks_total{reason="unreachable"} 3.0' in m


@pytest.mark.parametrize("setup", [{"reservation": "inproc"}], indirect=True)
def test_inproc_reservation_api_is_mounted_on_the_proxy(setup):
    """With the service in the proxy, connectors register lanes at /reservation."""
    url = setup.url + "/reservation/v1/lanes"
    r = httpx.post(url, json={"src_host": "l0h1", "dst_host": "l1h1", "lanes": [
        {"lane": 0, "src_port": 41000}, {"lane": 1, "src_port": 41001}]})
    assert r.status_code == 200, r.text
    assert httpx.post(url, json={"src_host": "l0h1"}).status_code == 422
    st = httpx.get(setup.url + "/reservation/v1/state").json()
    assert st["lanes_known"]["l0h1->l1h1"] == [[0, 41000], [1, 41001]]
    assert post(setup.url, BODY).status_code == 200  # l0h0 -> l1h0, lanes from the fixture
    kvp = setup.pb[0].received[-1]["body"]["kv_transfer_params"]["kvpath"]
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
