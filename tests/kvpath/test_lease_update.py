"""A live lease's flow, better known: ``ReservationService.update`` (its bytes on its
links, when it expects to end), over HTTP (``POST /v1/lease``), through each client, and
in the decision log that replay reproduces."""

import asyncio
import contextlib
import math
import random

import pytest
from fastapi.testclient import TestClient

from kvpath.reservation import wire
from kvpath.reservation.app import create_app
from kvpath.reservation.clients import HttpReserver, InProcessReserver
from kvpath.reservation.decisions import MAX_UPDATES_PER_LEASE, ReservationError, ReservationService
from kvpath.reservation.notifier import ReservationNotifier
from kvpath.reservation.replay import replay
from tests.kvpath.test_reservation import SPEC, Clock, lanes_covering_spines

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _link_bytes(svc: ReservationService, r) -> list[int]:
    return [svc.loads.bytes.get(link, 0) for link in r.path.links]


def test_an_update_replaces_the_bytes_on_the_leases_links_and_keeps_its_flow():
    clock = Clock()
    svc = ReservationService(SPEC, "cc", clock=clock, metric="bytes")
    r = svc.reserve("l0h0", "l1h0", 1000, lanes_covering_spines("l0h0", "l1h0"))
    flows = dict(svc.loads.flows)
    assert set(_link_bytes(svc, r)) == {1000}
    assert svc.update(r.lease_id, 7000) is r and r.bytes == 7000
    assert set(_link_bytes(svc, r)) == {7000} and svc.loads.flows == flows
    assert svc.release(r.lease_id)
    assert svc.loads.total_flows() == 0 and not any(svc.loads.bytes.values())  # back to zero exactly


def test_a_bigger_flow_moves_the_next_decision_off_its_spine():
    """metric bytes: two flows on two spines; one grows; the next flow takes the other's."""
    clock = Clock()
    svc = ReservationService(SPEC, "cc", clock=clock, metric="bytes")
    lanes = lanes_covering_spines("l0h0", "l1h0", n=2)
    a = svc.reserve("l0h0", "l1h0", 100, lanes)
    b = svc.reserve("l0h0", "l1h0", 200, lanes)
    assert a.path.spine != b.path.spine
    # without the update the next flow goes beside a (fewer bytes); with it, beside b
    assert svc.reserve("l0h0", "l1h0", 1, lanes, transfer_id="probe").path.spine == a.path.spine
    svc.release(svc.decisions[-1]["lease_id"])
    svc.update(a.lease_id, 10**6)
    assert svc.reserve("l0h0", "l1h0", 1, lanes).path.spine == b.path.spine


def test_the_expected_end_holds_the_lease_that_long_past_it():
    clock = Clock()
    svc = ReservationService(SPEC, "cc", clock=clock, lease_s=5)
    r = svc.reserve("l0h0", "l1h0", 10, lanes_covering_spines("l0h0", "l1h0"))
    clock.t += 4
    svc.update(r.lease_id, 10, expected_end_s=20)  # now + 20 + 5
    clock.t += 24.9
    assert svc.expire() == 0 and r.lease_id in svc.active  # past its first lease, held
    clock.t += 0.2
    assert svc.expire() == 1 and not svc.active
    assert svc.update(r.lease_id, 10) is None and svc.counters["updates_unknown"] == 1  # ended: nothing to update


def test_an_update_holds_a_lease_at_most_ten_lease_times_ahead():
    clock = Clock()
    svc = ReservationService(SPEC, "cc", clock=clock, lease_s=5)
    r = svc.reserve("l0h0", "l1h0", 10, lanes_covering_spines("l0h0", "l1h0"))
    svc.update(r.lease_id, 10, expected_end_s=3000)
    assert r.expires_at == clock.t + 50


@pytest.mark.parametrize("nbytes, expected, field", [
    (-1, None, "bytes"), (True, None, "bytes"), (2 ** 41, None, "bytes"),
    (5, -1.0, "expected_end_s"), (5, math.nan, "expected_end_s"), (5, 1e9, "expected_end_s"),
])
def test_bad_updates_are_refused_naming_the_field(nbytes, expected, field):
    svc = ReservationService(SPEC, "cc", clock=Clock())
    r = svc.reserve("l0h0", "l1h0", 10, lanes_covering_spines("l0h0", "l1h0"))
    with pytest.raises(ReservationError, match=field):
        svc.update(r.lease_id, nbytes, expected)
    assert r.bytes == 10


def test_a_lease_takes_a_bounded_number_of_updates():
    svc = ReservationService(SPEC, "cc", clock=Clock())
    r = svc.reserve("l0h0", "l1h0", 10, lanes_covering_spines("l0h0", "l1h0"))
    for i in range(MAX_UPDATES_PER_LEASE):
        svc.update(r.lease_id, 11 + i)
    with pytest.raises(ReservationError, match="updated"):
        svc.update(r.lease_id, 5)
    assert len(svc.decisions[-1]["updates"]) == MAX_UPDATES_PER_LEASE


def _logged_with_updates(seed: int = 4) -> list[dict]:
    clock, rng = Clock(), random.Random(seed)
    svc = ReservationService(SPEC, "cc", clock=clock, metric="bytes")
    srcs = [f"l0h{i}" for i in range(4)]
    lanes = {s: lanes_covering_spines(s, "l1h0", first_port=41000 + 100 * i) for i, s in enumerate(srcs)}
    active = []
    for step in range(300):
        clock.t += rng.random() * 0.01
        x = rng.random()
        if active and x < 0.3:
            svc.release(active.pop(rng.randrange(len(active))).lease_id)
        elif active and x < 0.6:
            with contextlib.suppress(ReservationError):  # (a lease's updates are bounded)
                svc.update(rng.choice(active).lease_id, rng.randint(1, 10**9))
        else:
            s = rng.choice(srcs)
            active.append(svc.reserve(s, "l1h0", rng.randint(1, 10**6), lanes[s], transfer_id=f"t{step}"))
    return list(svc.decisions)


def test_replay_applies_the_logged_updates_in_order():
    log = _logged_with_updates()
    assert sum(len(d.get("updates", ())) for d in log) > 50
    r = replay(log, SPEC, "cc", metric="bytes")
    assert (r.same_lane, r.differing) == (len(log), [])
    # the updates decided something: without them the replay chooses otherwise
    stripped = [{k: v for k, v in d.items() if k != "updates"} for d in log]
    assert replay(stripped, SPEC, "cc", metric="bytes").same_lane < len(log)


@pytest.fixture
def client():
    with TestClient(create_app(ReservationService(SPEC, "cc", lease_s=5), token=TOKEN), headers=AUTH) as c:
        yield c


def _reserve(client) -> str:
    lanes = [{"lane": i, "src_port": 40000 + i} for i in range(4)]
    assert client.post("/v1/lanes", json={"src_host": "l0h0", "dst_host": "l1h1", "lanes": lanes}).status_code == 200
    return client.post("/v1/reserve", json={"src_host": "l0h0", "dst_host": "l1h1", "bytes": 1000}).json()["lease_id"]


def test_post_lease_updates_a_live_lease_and_answers_an_ended_one(client):
    lease = _reserve(client)
    r = client.post(wire.LEASE_PATH, json={"lease_id": lease, "bytes": 5000, "expected_end_s": 30})
    assert r.status_code == 200
    a = r.json()
    assert (a["lease_id"], a["updated"], a["bytes"]) == (lease, True, 5000) and 34 < a["expires_in_s"] <= 35
    assert {v["bytes"] for v in client.get("/v1/state").json()["links"].values()} == {5000}
    client.post("/v1/release", json={"lease_id": lease})
    a = client.post(wire.LEASE_PATH, json={"lease_id": lease, "bytes": 1}).json()
    assert (a["updated"], a["bytes"]) == (False, 0)
    assert 'kvpath_lease_updates_total{known="true"} 1.0' in client.get("/metrics").text


@pytest.mark.parametrize("body, field", [
    ({"bytes": 5}, "lease_id"), ({"lease_id": "r1", "bytes": -5}, "bytes"),
    ({"lease_id": "r1", "bytes": 5, "expected_end_s": 1e9}, "expected_end_s"),
    ({"lease_id": "r1", "bytes": 5, "expected_end_s": -1}, "expected_end_s"),
    ({"lease_id": "x" * 65, "bytes": 5}, "lease_id"),
])
def test_post_lease_bad_input_is_422_naming_the_field(client, body, field):
    r = client.post(wire.LEASE_PATH, json=body)
    assert r.status_code == 422 and field in r.text


def test_post_lease_needs_the_token_and_json(client):
    assert client.post(wire.LEASE_PATH, json={"lease_id": "r1", "bytes": 5},
                       headers={"authorization": ""}).status_code == 401
    r = client.post(wire.LEASE_PATH, content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_each_client_updates_a_lease():
    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=5)
    lanes = lanes_covering_spines("l0h0", "l1h0")
    svc.register_lanes("l0h0", "l1h0", lanes)

    async def through(reserver) -> tuple[bool, bool]:
        g = await reserver.reserve("l0h0", "l1h0", 10)
        ok = await reserver.update(g.lease_id, 99, 1.5)
        assert svc.active[g.lease_id].bytes == 99
        await reserver.release(g.lease_id)
        await reserver.close()  # HttpReserver sends its releases together: close sends what is queued
        gone = await reserver.update(g.lease_id, 5)
        await reserver.close()
        return ok, gone

    assert asyncio.run(through(InProcessReserver(svc))) == (True, False)
    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        assert asyncio.run(through(HttpReserver(srv.url, timeout_s=5, token=TOKEN))) == (True, False)
        r = svc.reserve("l0h0", "l1h0", 10, lanes)
        n = ReservationNotifier(srv.url, token=TOKEN)
        n.update(r.lease_id, 1234, 2.0)
        n.close()  # drains the queue first
        assert n.stats.totals["reservation_calls_ok"] == 1 and svc.active[r.lease_id].bytes == 1234
