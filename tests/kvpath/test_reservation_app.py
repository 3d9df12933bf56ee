"""The reservation service over HTTP (FastAPI TestClient; the notifier tests use a real server)."""

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.reservation import wire
from kvpath.reservation.app import create_app
from kvpath.reservation.clients import HttpReserver, InProcessReserver
from kvpath.reservation.decisions import ReservationService, SyncReserver
from kvpath.reservation.notifier import ReservationNotifier
from kvpath.testbed.readiness import free_port
from kvpath.testbed.stub_engine import ServerThread

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
LANES = [{"lane": i, "src_port": 40000 + i} for i in range(4)]
TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client():
    """A client that holds the token (tests/kvpath/test_reservation_auth.py: the calls without it)."""
    with TestClient(create_app(ReservationService(SPEC, "cc", lease_s=5), token=TOKEN), headers=AUTH) as c:
        yield c


def test_reserve_release_roundtrip(client):
    assert client.post("/v1/lanes", json={"src_host": "l0h0", "dst_host": "l1h1", "lanes": LANES}).status_code == 200
    r = client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "l1h1", "bytes": 1000, "lanes": LANES})
    assert r.status_code == 200
    d = r.json()
    assert d["lane"] in range(4) and d["path"][0] == "l0h0" and d["spine"].startswith("spine") and d["lease_id"]
    assert client.get("/v1/state").json()["active"] == 1
    assert client.post("/v1/release", json={"lease_id": d["lease_id"]}).json()["released"] is True
    assert client.post("/v1/release", json={"lease_id": d["lease_id"]}).json()["released"] is False
    st = client.get("/v1/state").json()
    assert st["active"] == 0 and st["reserved_flows"] == 0
    m = client.get("/metrics").text
    assert 'kvpath_reservations_total{mode="cc",outcome="decided"} 1.0' in m
    assert "kvpath_active_leases 0.0" in m


def test_registered_lanes_by_ip_are_used(client):
    assert client.post("/v1/lanes", json={"src_host": "10.0.2.1", "dst_host": "l1h0", "lanes": LANES}).status_code == 200
    r = client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "10.1.2.1", "bytes": 5}).json()
    assert r["lane"] is not None and r["fallback"] == ""
    r = client.post("/v1/reserve", json={"src_host": "l0h1", "dst_host": "l1h0", "bytes": 5}).json()
    assert r["lane"] is None and r["fallback"] == "no_lanes"


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/v1/reserve", {"dst_host": "l1h0", "bytes": 1}, 422, "src_host"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": -5}, 422, "bytes"),
        ("/v1/reserve", {"src_host": "l9h9", "dst_host": "l1h0", "bytes": 1}, 422, "src_host"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1, "lanes": [{"lane": 0, "src_port": 70000}]}, 422, "src_port"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1, "lanes": [{"lane": 0, "src_port": 1}, {"lane": 0, "src_port": 2}]}, 422, "lane"),
        ("/v1/release", {}, 422, "lease_id"),
        ("/v1/lanes", {"src_host": "l0h0", "dst_host": "l1h0", "lanes": []}, 422, "lanes"),
        # exactly tcp or udp: a regex's $ also matches before a trailing newline
        ("/v1/lanes", {"src_host": "l0h0", "dst_host": "l1h0", "lanes": [{"lane": 0, "src_port": 1, "proto": "tcp\n"}]},
         422, "proto"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1,
                         "lanes": [{"lane": 0, "src_port": 1, "proto": "TCP"}]}, 422, "proto"),
        # at most 1,024 lanes in one request or registration
        ("/v1/lanes", {"src_host": "l0h0", "dst_host": "l1h0",
                       "lanes": [{"lane": i % 1024, "src_port": 1} for i in range(1025)]}, 422, "lanes"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1,
                         "lanes": [{"lane": i % 1024, "src_port": 1} for i in range(1025)]}, 422, "lanes"),
        # a pair's engine ids: no separator of its name
        ("/v1/lanes", {"src_host": "l0h0", "dst_host": "l1h0", "lanes": [{"lane": 0, "src_port": 1}],
                       "pair": {"p_engine": "p/r0>x", "d_engine": "d"}}, 422, "pair.p_engine"),
        ("/v1/reserve", {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1, "scope": {"p_rank": -1}}, 422,
         "scope.p_rank"),
    ],
)
def test_bad_input_is_4xx_naming_the_field(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status
    assert field in r.text


@pytest.mark.parametrize("raw", [
    b"{nope",
    b'{"src_host": "l0h0\xff", "dst_host": "l1h0", "bytes": 1, "lease_id": "r\xff"}',  # not UTF-8
    b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nesting past the recursion limit, in an ignored field
])
@pytest.mark.parametrize("path", ["/v1/reserve", "/v1/release", "/v1/lanes"])
def test_invalid_json_is_400(client, path, raw):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]


LANES_BODY = {"src_host": "l0h0", "dst_host": "l1h0", "lanes": LANES}


def test_every_call_needs_the_token_before_its_body_is_looked_at(client):
    bare = {"authorization": ""}
    assert client.post("/v1/lanes", json={"src_host": "l0h0"}, headers=bare).status_code == 401
    assert client.post("/v1/reserve", json={"src_host": "l0h0"}, headers=bare).status_code == 401
    assert client.post("/v1/release", json={}, headers=bare).status_code == 401
    # the reads name agents, live transfer ids and lease ids
    assert client.get("/v1/state", headers=bare).status_code == 401
    assert client.get("/v1/decisions", headers=bare).status_code == 401
    assert client.get("/v1/state").json()["lanes_known"] == {}
    assert client.post("/v1/lanes", json=LANES_BODY).status_code == 200
    r = client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "l1h0", "bytes": 5})
    assert r.status_code == 200 and r.json()["lane"] is not None
    assert client.post("/v1/release", json={"lease_id": r.json()["lease_id"]}).json()["released"] is True
    assert client.get("/v1/decisions").json()["decisions"][0]["transfer_id"] is not None
    assert client.get("/health", headers=bare).status_code == 200
    assert client.get("/metrics", headers=bare).status_code == 200


def test_p_connector_notifier_sends_the_token():
    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=5)
    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        for token in (None, TOKEN):
            n = ReservationNotifier(srv.url, token=token)
            n.register_lanes("l0h1", "l1h1", [(0, 41000), (1, 41001)])
            n.close()  # drains the queue first
            ok = n.stats.totals["reservation_calls_ok"], n.stats.totals["reservation_calls_failed"]
            assert ok == ((0, 1) if token is None else (1, 0))
    assert svc.lanes("l0h1", "l1h1")[1].src_port == 41001


def test_p_connector_reserves_a_lane_at_push_time_and_gets_none_when_the_service_is_down():
    import threading

    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=5)
    got: list[tuple] = []
    done = threading.Event()

    def answer(tid, lane, lease):
        got.append((tid, lane, lease))
        done.set()

    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        n = ReservationNotifier(srv.url, token=TOKEN)
        n.register_lanes("l0h1", "l1h1", [(0, 41000), (1, 41001)])
        time.sleep(0.5)  # the registration is on the other thread: let it land first
        n.reserve("l0h1", "l1h1", 1_000_000, transfer_id="t1", done=answer)
        assert done.wait(5)
        n.close()
    assert got[0][0] == "t1" and got[0][1] in (0, 1) and got[0][2] in svc.active
    down = ReservationNotifier(f"http://127.0.0.1:{free_port()}")
    done.clear()
    t0 = time.monotonic()
    down.reserve("l0h1", "l1h1", 1, transfer_id="t2", done=answer)
    assert done.wait(5) and got[1] == ("t2", None, None) and time.monotonic() - t0 < 2
    down.close()


# the reserve answer's fields, in the order the service has always written them
ANSWER_FIELDS = ["lease_id", "transfer_id", "src_host", "dst_host", "bytes", "lane", "src_port", "path", "spine",
                 "spines", "expires_in_s", "mode", "fallback", "workers"]


def test_the_wire_answers_keep_their_json_shape(client):
    assert client.post("/v1/lanes", json={"src_host": "l0h0", "dst_host": "l1h1", "lanes": LANES}).status_code == 200
    r = client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "l1h1", "bytes": "1000", "lanes": LANES})
    assert r.status_code == 200 and list(r.json()) == ANSWER_FIELDS and r.json()["bytes"] == 1000  # "1000" read as 1000
    assert r.content == json.dumps(r.json(), separators=(",", ":")).encode()  # compact, as FastAPI wrote it
    fb = client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "l1h0", "bytes": 1}).json()
    assert list(fb) == ANSWER_FIELDS and fb["lane"] is None and fb["path"] is None and fb["spines"] == []
    rel = client.post("/v1/release", json={"lease_id": r.json()["lease_id"]})
    assert rel.json() == {"lease_id": r.json()["lease_id"], "released": True}
    assert client.post("/v1/lanes", json={"src_host": "l0h0", "dst_host": "l1h0", "lanes": LANES}).json() == \
        {"ok": True, "lanes": 4}
    assert client.post("/v1/reserve", content=b"", headers={"content-type": "application/json"}).status_code == 422


def _recording_service(batched: bool = True):
    """A stand-in service on a real socket: what each call sent (path, body, token), and
    the answers a service gives (``batched``: it has /v1/releases, as older ones do not)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[tuple[str, bytes, str | None]] = []

    async def handler(request: Request) -> JSONResponse:
        seen.append((request.url.path, await request.body(), request.headers.get("authorization")))
        if request.url.path == wire.RESERVE_PATH:
            return JSONResponse({"lease_id": "r1-ab", "lane": 3, "spine": "spine2", "fallback": ""})
        return JSONResponse({"lease_id": "r1-ab", "released": True})

    paths = (wire.RESERVE_PATH, wire.RELEASE_PATH) + ((wire.RELEASES_PATH,) if batched else ())
    app = Starlette(routes=[Route(p, handler, methods=["POST"]) for p in paths])
    return seen, ServerThread(app, free_port())


def test_the_clients_send_the_wire_bodies_the_service_always_read():
    """HttpReserver's request, byte for byte what its dict literal used to be; the
    answers come back through the wire's types."""
    seen, srv = _recording_service()

    async def go() -> wire.LaneGrant:
        res = HttpReserver(srv.url + "/", timeout_s=10)
        grant = await res.reserve("l0h0", "l1h0", 5, transfer_id="t1")
        await res.release("r1-ab")
        await res.close()
        return grant

    with srv:
        grant = asyncio.run(go())
    assert grant == wire.LaneGrant(3, "r1-ab", "spine2")
    old = {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 5, "transfer_id": "t1"}
    assert [x[:2] for x in seen] == [("/v1/reserve", json.dumps(old, separators=(",", ":")).encode()),
                                     ("/v1/releases", b'{"lease_ids":["r1-ab"]}')]
    lanes = wire.LanesRequest(src_host="l0h0", dst_host="l1h0", lanes=[wire.LaneInfo(0, 41000)])
    assert wire.encode(lanes) == b'{"src_host":"l0h0","dst_host":"l1h0","lanes":[{"lane":0,"src_port":41000}]}'


def test_the_http_reserver_sends_releases_together_and_the_service_ends_each_once():
    svc = ReservationService(SPEC, "cc", lease_s=30)
    svc.register_lanes("l0h0", "l1h0", [wire.LaneInfo(**x) for x in LANES])
    seen: list[bytes] = []
    app = create_app(svc, token=TOKEN)

    async def spy(scope, receive, send):  # what reached the service, call by call
        if scope["type"] == "http":
            seen.append(scope["path"].encode())
        await app(scope, receive, send)

    async def go() -> list:
        res = HttpReserver(srv.url, timeout_s=10, token=TOKEN)
        grants = [await res.reserve("l0h0", "l1h0", 5, transfer_id=f"t{k}") for k in range(5)]
        for g in grants:
            await res.release(g.lease_id)
        await res.release(grants[0].lease_id)  # twice: the second is unknown
        await res.close()  # sends what is queued
        return grants

    with ServerThread(spy, free_port()) as srv:
        grants = asyncio.run(go())
    assert all(g.lease_id for g in grants)
    assert seen.count(wire.RELEASES_PATH.encode()) == 1 and wire.RELEASE_PATH.encode() not in seen
    assert not svc.active and svc.counters["releases"] == 5 and svc.counters["releases_unknown"] == 1
    with TestClient(app, headers=AUTH) as c:
        assert c.post(wire.RELEASES_PATH, json={"lease_ids": []}).status_code == 422
        assert c.post(wire.RELEASES_PATH, json={"lease_ids": ["x"] * (wire.MAX_RELEASES + 1)}).status_code == 422
        assert c.post(wire.RELEASES_PATH, json={"lease_ids": ["nope"]}).json() == {"released": 0, "unknown": 1}


def test_against_a_service_without_batched_releases_each_goes_alone():
    seen, srv = _recording_service(batched=False)

    async def go() -> None:
        res = HttpReserver(srv.url, timeout_s=10)
        for lid in ("r1-a", "r2-b"):
            await res.release(lid)
        await res.close()

    with srv:
        asyncio.run(go())
    assert [x[:2] for x in seen] == [("/v1/release", b'{"lease_id":"r1-a"}'), ("/v1/release", b'{"lease_id":"r2-b"}')]


def test_each_caller_has_its_protocol():
    svc = ReservationService(SPEC, "cc")
    assert isinstance(svc, SyncReserver)
    assert isinstance(InProcessReserver(svc), wire.AsyncReserver)
    assert isinstance(HttpReserver("http://127.0.0.1:1"), wire.AsyncReserver)
    n = ReservationNotifier("http://127.0.0.1:1")
    assert isinstance(n, wire.QueuedReserver)
    n.close()


def test_in_process_reserver_grants_and_falls_back_like_the_http_one():
    svc = ReservationService(SPEC, "cc", lease_s=5)
    res = InProcessReserver(svc)
    lanes = [wire.LaneInfo(i, 40000 + i) for i in range(4)]
    grant = asyncio.run(res.reserve("l0h0", "l1h1", 10, lanes, transfer_id="t1"))
    assert grant.lane in range(4) and grant.lease_id in svc.active and grant.spine.startswith("spine")
    asyncio.run(res.release(grant.lease_id))
    assert not svc.active
    assert asyncio.run(res.reserve("l0h0", "l1h0", 10)) == wire.LaneGrant(fallback="no_lanes")
    assert asyncio.run(res.reserve("l9h9", "l1h0", 10)).fallback.startswith("rejected: src_host")


def test_p_connector_notifier_registers_lanes_given_as_5_tuple_dicts_or_lane_infos():
    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=5)
    rows = [{"lane": 0, "src_ip": "10.0.2.1", "src_port": 41000, "dst_ip": "10.1.3.1", "dst_port": KV_SIDE_CHANNEL_PORT, "proto": "tcp"}]
    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        n = ReservationNotifier(srv.url, token=TOKEN)
        n.register_lanes("l0h0", "l1h1", rows, "w0")
        n.register_lanes("l0h0", "l1h1", [wire.LaneInfo(1, 41001, KV_SIDE_CHANNEL_PORT)], "w1")
        n.register_lanes("l0h0", "l1h1", [{"lane": 0, "src_port": 70000}], "w2")  # refused here, never sent
        n.close()
    assert svc.lanes("l0h0", "l1h1", "w0") == [wire.LaneInfo(0, 41000, KV_SIDE_CHANNEL_PORT, "10.0.2.1", "10.1.3.1")]
    assert svc.lanes("l0h0", "l1h1", "w1") == [wire.LaneInfo(1, 41001, KV_SIDE_CHANNEL_PORT)]
    assert svc.lanes("l0h0", "l1h1", "w2") == []
    assert n.stats.totals["reservation_calls_ok"] == 2 and n.stats.totals["reservation_calls_failed"] == 1


def test_a_huge_bad_value_is_not_echoed_and_a_planted_location_is_not_believed(client):
    proto = "x - at `$.admin`" + "y" * 100_000
    body = {"src_host": "l0h0", "dst_host": "l1h1", "bytes": 1, "lanes": [{"lane": 0, "src_port": 1, "proto": proto}]}
    r = client.post("/v1/reserve", json=body)
    assert r.status_code == 422 and len(r.content) < 2000
    assert "admin" not in json.dumps(r.json().get("fields", r.json()))


def test_a_worker_pairs_lanes_are_unregistered_when_its_engine_goes():
    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=5)
    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        n = ReservationNotifier(srv.url, token=TOKEN)
        n.register_lanes("l0h1", "l1h1", [(0, 41000), (1, 41001)], worker="p/r0>d-a")
        n.register_lanes("l0h1", "l1h1", [(0, 42000)], worker="p/r0>d-b")
        n.unregister_lanes("l0h1", "l1h1", worker="p/r0>d-a")
        n.close()  # sends its backlog in order first
        assert n.stats.totals["reservation_calls_ok"] == 3
        assert svc.lanes("l0h1", "l1h1", "p/r0>d-a") == [] and len(svc.lanes("l0h1", "l1h1", "p/r0>d-b")) == 1
        # the token is needed, and an unknown pair is answered ok=false
        body = {"src_host": "l0h1", "dst_host": "l1h1", "worker": "p/r0>d-b"}
        assert httpx.post(srv.url + "/v1/lanes/unregister", json=body).status_code == 401
        r = httpx.post(srv.url + "/v1/lanes/unregister", json={**body, "worker": "nobody"},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json() == {"ok": False, "lanes": 0}
        r = httpx.post(srv.url + "/v1/lanes/unregister", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.json() == {"ok": True, "lanes": 1}
    # no lanes left for the host pair: a reservation falls back instead of charging a gone pair
    assert svc.reserve("l0h1", "l1h1", 1000).fallback == "no_lanes"
