"""The P/D proxy against stub engines: routing and the legs of each mode, the transfer
id, placement policies, reservations, concurrency, P's TP size."""

import asyncio
import time

import httpx
import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.proxy.config import TRANSFER_ID_HEADER
from kvpath.reservation.decisions import LaneInfo
from kvpath.reservation.wire import WorkerPair
from tests.proxy.proxy_stubs import BODY, RES_TOKEN, post, wait_until


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
    assert wait_until(lambda: setup.svc.state()["active"] == 0)
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
    assert wait_until(lambda: setup.svc.state()["active"] == 0)



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
