"""The proxy's joint and network policies against stub engines: P, D and the lane chosen
by the reservation service in one decision (docs/placement.md), in process and over
HTTP; what the proxy tells it (in-flight counts, P's queued prompt tokens); the fallback
when it cannot place."""

import httpx
import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.iteration_time import IterationTimeModel
from kvpath.placement import CostModel
from kvpath.proxy.config import ProxyConfig
from kvpath.proxy.core import Proxy
from kvpath.proxy.instances import Instance
from kvpath.reservation.app import create_app as create_reservation_app
from kvpath.reservation.clients import HttpReserver, InProcessReserver
from kvpath.reservation.decisions import ReservationService
from kvpath.reservation.wire import WorkerPair
from kvpath.proxy.app import create_app
from kvpath.testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app
from tests.proxy.proxy_stubs import BODY, PORTS, RES_TOKEN, SPEC, lanes, wait_until

P_HOSTS, D_HOSTS = ("l0h0", "l0h1"), ("l1h0", "l1h1")


class Placed:
    """Two P stubs and two D stubs on four hosts, every engine pair's lanes registered,
    a proxy with ``policy`` and the service in process or over HTTP (``cost``: whether
    the service has a cost model)."""

    def __init__(self, policy="joint", reservation="inproc", cost=True):
        self.servers = []
        self.pb = [StubBehaviour() for _ in P_HOSTS]
        self.db = [StubBehaviour() for _ in D_HOSTS]
        p = [self._serve(create_stub_app(f"P{i}", b)) for i, b in enumerate(self.pb)]
        d = [self._serve(create_stub_app(f"D{i}", b)) for i, b in enumerate(self.db)]
        self.svc = ReservationService(SPEC, "cc", lease_s=30)
        for i, ph in enumerate(P_HOSTS):
            for j, dh in enumerate(D_HOSTS):
                self.svc.register_lanes(ph, dh, lanes(), pair=WorkerPair(p_engine=f"p{i}", d_engine=f"d{j}"))
        model = CostModel(SPEC, IterationTimeModel.preset()) if cost else None
        if reservation == "http":
            res = self._serve(create_reservation_app(self.svc, token=RES_TOKEN, cost=model))
            reserver = HttpReserver(res.url, timeout_s=2.0, token=RES_TOKEN)
        else:
            reserver = InProcessReserver(self.svc, model)
        self.proxy = Proxy(ProxyConfig(mode="push", policy=policy, admin_token="s3cret"),
                           [Instance(s.url, "prefill", P_HOSTS[i], f"127.0.0.1:{KV_SIDE_CHANNEL_PORT + i}", f"p{i}")
                            for i, s in enumerate(p)],
                           [Instance(s.url, "decode", D_HOSTS[i], engine_id=f"d{i}") for i, s in enumerate(d)],
                           reserver)
        self.url = self._serve(create_app(self.proxy)).url

    def _serve(self, app):
        s = ServerThread(app, next(PORTS)).start()
        self.servers.append(s)
        return s

    def close(self):
        for s in reversed(self.servers):
            s.stop()

    def pool(self, role):
        return self.proxy.pools[role].all()


@pytest.fixture
def placed(request):
    s = Placed(**getattr(request, "param", {}))
    yield s
    s.close()


def _routed(s: Placed) -> list[tuple[int, int]]:
    """(P index, D index) of every request so far, from the legs the stubs received."""
    out = {}
    for i, b in enumerate(s.pb):
        for r in b.received:
            out.setdefault(r["headers"].get("x-request-id"), [None, None])[0] = i
    for j, b in enumerate(s.db):
        for r in b.received:
            out.setdefault(r["headers"].get("x-request-id"), [None, None])[1] = j
    return sorted(tuple(v) for v in out.values())


@pytest.mark.parametrize("placed", [{"reservation": "inproc"}, {"reservation": "http"}], indirect=True)
def test_joint_routes_where_the_service_placed_and_releases_the_lane(placed):
    for _ in range(4):
        r = httpx.post(placed.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200, r.text
    recs = [d for d in placed.svc.decisions if "placement" in d]
    assert len(recs) == 4 and all(d["placement"]["policy"] == "joint" for d in recs)
    urls = {i.url: k for k, i in enumerate(placed.pool("prefill"))}, {i.url: k for k, i in enumerate(placed.pool("decode"))}
    placed_at = sorted((urls[0][d["placement"]["p"]], urls[1][d["placement"]["d"]]) for d in recs)
    assert _routed(placed) == placed_at
    # the P leg carries the placed lane and lease; every lease ended with its request
    for d in recs:
        leg = next(r for b in placed.pb for r in b.received
                   if r["body"]["kv_transfer_params"]["kvpath"]["transfer_id"] == d["transfer_id"])
        assert leg["body"]["kv_transfer_params"]["kvpath"]["lane"] == d["lane"]
        assert leg["body"]["kv_transfer_params"]["kvpath"]["lease_id"] == d["lease_id"]
    assert wait_until(lambda: placed.svc.state()["active"] == 0)


def test_a_p_with_queued_prompts_is_passed_over_by_joint_but_not_by_network(placed):
    p0 = placed.pool("prefill")[0]
    p0.queued_tokens = 200_000  # as if long prompts were prefilling there
    assert httpx.post(placed.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert placed.svc.decisions[-1]["placement"]["p"] == placed.pool("prefill")[1].url
    placed.proxy.cfg.policy = "network"  # P by least outstanding: both idle, the first
    assert httpx.post(placed.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert placed.svc.decisions[-1]["placement"]["p"] == p0.url
    p0.queued_tokens = 0
    # the proxy's own count returns to zero when the legs end
    assert wait_until(lambda: all(i.queued_tokens == 0 and i.inflight == 0
                                  for i in (*placed.pool("prefill"), *placed.pool("decode"))))


@pytest.mark.parametrize("placed", [{"cost": False}], indirect=True)
def test_a_service_that_cannot_place_falls_back_to_least_outstanding_and_counts(placed):
    assert httpx.post(placed.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert not any("placement" in d for d in placed.svc.decisions)
    assert placed.svc.decisions[-1]["lane"] is not None  # the lane reserved as it would be without
    m = httpx.get(placed.url + "/metrics").text
    assert 'kvpath_proxy_reservation_fallbacks_total{reason="place_not_configured"} 1.0' in m


def test_place_over_http_refuses_bad_input_naming_the_field(placed):
    c = ServerThread(create_reservation_app(placed.svc, token=RES_TOKEN,
                                            cost=CostModel(SPEC, IterationTimeModel.preset())), next(PORTS)).start()
    placed.servers.append(c)
    h = {"Authorization": f"Bearer {RES_TOKEN}"}
    good = {"prefill": [{"name": "p", "host": "l0h0"}], "decode": [{"name": "d", "host": "l1h0"}],
            "prompt_tokens": 10, "bytes": 100}
    assert httpx.post(c.url + "/v1/place", json=good).status_code == 401
    r = httpx.post(c.url + "/v1/place", json=good, headers=h)
    assert r.status_code == 200 and r.json()["prefill"] == "p" and r.json()["predicted"]["ttft_s"] > 0
    for bad, field in (({"prefill": []}, "prefill"), ({"prompt_tokens": 0}, "prompt_tokens"),
                       ({"policy": "fastest"}, "policy"), ({"decode": [{"name": "d", "host": "l9h9"}]}, "decode.0.host"),
                       ({"bytes": -1}, "bytes")):
        r = httpx.post(c.url + "/v1/place", json={**good, **bad}, headers=h)
        assert r.status_code == 422 and field in r.text, (bad, r.text)


def test_the_testbeds_proxy_costs_placements_on_the_emulated_engines_clock(tmp_path):
    """The testbed hands the proxy the emulated engines' model, accelerator, time scale
    (B/S) and push granularity: the placement's cost model is theirs."""
    import dataclasses

    from kvpath.cli import build_parser
    from kvpath.reservation.cli import build_cost
    from kvpath.testbed.engine_kinds import engines_for
    from kvpath.testbed.orchestrator import proxy_argv
    from tests.kvpath.test_reservation_auth import _site

    site = _site(tmp_path)
    site = dataclasses.replace(site, cfg=dataclasses.replace(site.cfg, policy="joint", push_granularity="layer",
                                                             layer_group=2))
    argv = proxy_argv(site, engines_for(site))
    args = build_parser().parse_args(argv[argv.index("proxy"):])
    assert args.policy == "joint"
    cost = build_cost(args, SPEC)
    assert cost.time_scale == site.cfg.scale_b / site.cfg.scale_s
    assert (cost.itm.model.name, cost.granularity, cost.layer_group) == (site.cfg.model, "layer", 2)


def test_a_placement_that_timed_out_reserves_nothing_more(placed):
    """The service may have placed (and reserved) an answer that never came: the proxy
    picks by least outstanding and sends P no lane, never reserving a second time."""
    class TimedOut:
        def __init__(self, inner):
            self.inner = inner

        async def place(self, req):
            return "timeout"

        def __getattr__(self, name):
            return getattr(self.inner, name)

    placed.proxy.reserver = TimedOut(placed.proxy.reserver)
    n = len(placed.svc.decisions)
    assert httpx.post(placed.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert len(placed.svc.decisions) == n  # no reservation made
    leg = next(r for b in placed.pb for r in b.received)
    assert leg["body"]["kv_transfer_params"]["kvpath"].get("lane") is None
    m = httpx.get(placed.url + "/metrics").text
    assert 'kvpath_proxy_reservation_fallbacks_total{reason="place_timeout"} 1.0' in m
