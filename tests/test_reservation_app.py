"""The reservation service over HTTP (FastAPI TestClient, no sockets)."""

import pytest
from fastapi.testclient import TestClient

from kvpath.fabric import FabricSpec
from proxy.reservation import ReservationService
from proxy.reservation_app import create_app

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
LANES = [{"lane": i, "src_port": 40000 + i} for i in range(4)]


@pytest.fixture
def client():
    with TestClient(create_app(ReservationService(SPEC, "cc", lease_s=5))) as c:
        yield c


def test_reserve_release_roundtrip(client):
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
    ],
)
def test_bad_input_is_4xx_naming_the_field(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status
    assert field in r.text


def test_invalid_json_is_400(client):
    r = client.post("/v1/reserve", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
