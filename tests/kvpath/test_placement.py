"""Joint placement (kvpath/placement.py, kvpath/reservation/placer.py): P, D and the lane
chosen together by predicted TTFT, reserved in the same step; its ablations; the guard;
pruning that never changes the choice; bad input refused naming the field."""

import itertools
import random

import pytest

from kvpath.iteration_time import IterationTimeModel
from kvpath.placement import CostModel, EngineState, PlacementError
from kvpath.reservation.decisions import ReservationError, ReservationService
from kvpath.reservation.placer import place
from tests.kvpath.test_reservation import SPEC, Clock, lanes_covering_spines

ITM = IterationTimeModel.preset("llama-3-8b", "h100")
MB = 1 << 20


def _service(mode="cc", ps=("l0h0", "l0h1"), ds=("l1h0", "l1h1"), lanes=4):
    clock = Clock()
    svc = ReservationService(SPEC, mode, clock=clock)
    for k, (p, d) in enumerate(itertools.product(ps, ds)):
        svc.register_lanes(p, d, lanes_covering_spines(p, d, n=lanes, first_port=41000 + 100 * k))
    return svc


def _cost(**kw):
    return CostModel(SPEC, ITM, **kw)


def test_joint_takes_the_idle_p_the_light_d_and_a_free_spine_and_reserves_it():
    svc = _service()
    ps = [EngineState("p0", "l0h0", outstanding=1, queued_tokens=30_000), EngineState("p1", "l0h1")]
    ds = [EngineState("d0", "l1h0", outstanding=30), EngineState("d1", "l1h1", outstanding=29)]
    pl = place(svc, _cost(), ps, ds, 2000, 200 * MB, transfer_id="t1")
    assert (pl.p, pl.d) == (1, 1)
    r = pl.reservation
    assert r.lane is not None and r.src_host == "l0h1" and r.dst_host == "l1h1" and r.lease_id in svc.active
    rec = svc.decisions[-1]["placement"]
    assert (rec["p"], rec["d"], rec["policy"]) == ("p1", "d1", "joint")
    assert rec["predicted"]["ttft_s"] == pytest.approx(pl.prediction.ttft_s)
    # the next identical request does not take the spine just reserved: the two are one decision each
    pl2 = place(svc, _cost(), ps, ds, 2000, 200 * MB, transfer_id="t2")
    assert pl2.reservation.path.spine != r.path.spine


def test_a_busy_uplink_moves_the_push_to_another_p():
    """Equal queues: P0's host uplink already carries a large push, so P1 is faster."""
    svc = _service()
    ps = [EngineState("p0", "l0h0"), EngineState("p1", "l0h1")]
    ds = [EngineState("d0", "l1h0")]
    svc.reserve("l0h0", "l1h1", 2000 * MB)  # on l0h0's uplink, whichever spine
    pl = place(svc, _cost(), ps, ds, 1000, 500 * MB)
    assert pl.p == 1


def test_the_guard_keeps_a_piled_on_instance_out_even_when_it_looks_cheapest():
    svc = _service()
    ps = [EngineState("p0", "l0h0", outstanding=10), EngineState("p1", "l0h1", outstanding=0, queued_tokens=80_000)]
    ds = [EngineState("d0", "l1h0")]
    assert place(svc, _cost(), ps, ds, 1000, MB, guard=4).p == 1  # p0 is 10 above the least: not a candidate
    assert place(svc, _cost(), ps, ds, 1000, MB, guard=20).p == 0  # allowed: its empty queue wins


def test_the_ablations_choose_by_their_own_parts():
    svc = _service()
    ps = [EngineState("p0", "l0h0", outstanding=0, queued_tokens=60_000), EngineState("p1", "l0h1", outstanding=1)]
    ds = [EngineState("d0", "l1h0", outstanding=2), EngineState("d1", "l1h1", outstanding=1)]
    assert (place(svc, _cost(), ps, ds, 1000, MB, policy="load").p,) == (0,)  # least outstanding, blind to its queue
    pl = place(svc, _cost(), ps, ds, 1000, MB, policy="network")
    assert pl.p == 0 and pl.d == 1  # P by load; D by admission and push
    assert place(svc, _cost(), ps, ds, 1000, MB, policy="joint").p == 1  # the queue counts


def test_load_takes_the_services_own_lane():
    a, b = _service("cc"), _service("cc")
    ps, ds = [EngineState("p0", "l0h0")], [EngineState("d0", "l1h0")]
    for k in range(6):
        pl = place(a, _cost(), ps, ds, 100, MB, transfer_id=f"t{k}", policy="load")
        r = b.reserve("l0h0", "l1h0", MB, transfer_id=f"t{k}")
        assert pl.reservation.lane == r.lane


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_pruning_never_changes_the_choice(granularity):
    """16 x 16 engines on 4 x 4 hosts x 4 lanes with random queues and loads: the pruned
    search takes the candidate a brute-force search over every (P, D, lane) takes."""
    hosts_p, hosts_d = [f"l0h{i}" for i in range(4)], [f"l1h{i}" for i in range(4)]
    svc = _service(ps=hosts_p, ds=hosts_d)
    rng = random.Random(5)
    for _ in range(40):  # load on the links
        svc.reserve(rng.choice(hosts_p), rng.choice(hosts_d), rng.randint(1, 400) * MB)
    cost = _cost(granularity=granularity)
    pruned_any = False
    for trial in range(20):
        ps = [EngineState(f"p{i}", hosts_p[i % 4], rng.randint(0, 3), rng.randint(0, 40_000)) for i in range(16)]
        ds = [EngineState(f"d{i}", hosts_d[i % 4], rng.randint(0, 3)) for i in range(16)]
        nbytes, tokens = rng.randint(1, 300) * MB, rng.randint(100, 6000)
        want = min(
            (cost.predict(i, p, j, d, c.lane.lane, c.paths, tokens, nbytes, svc.loads.link).ttft_s, i, j, c.lane.lane)
            for i, p in enumerate(ps) if p.outstanding <= min(x.outstanding for x in ps) + 4
            for j, d in enumerate(ds) if d.outstanding <= min(x.outstanding for x in ds) + 4
            for c in svc.candidates(p.host, d.host))
        pl = place(svc, cost, ps, ds, tokens, nbytes, transfer_id=f"x{trial}")
        assert pl.prediction.ttft_s == pytest.approx(want[0], rel=1e-12)
        pruned_any |= pl.considered < 16 * 16 * 4
        svc.release(pl.reservation.lease_id)
    assert pruned_any


def test_layer_wise_push_leaves_less_after_the_prefill():
    svc = _service()
    ps, ds = [EngineState("p0", "l0h0")], [EngineState("d0", "l1h0")]
    whole = place(svc, _cost(), ps, ds, 4000, 500 * MB).prediction
    layered = place(svc, _cost(granularity="layer"), ps, ds, 4000, 500 * MB).prediction
    assert 0 < layered.push_s < whole.push_s


def test_a_pair_without_lanes_is_placed_without_a_lane():
    svc = ReservationService(SPEC, "cc", clock=Clock())
    pl = place(svc, _cost(), [EngineState("p0", "l0h0")], [EngineState("d0", "l1h0")], 100, MB)
    assert pl.reservation.fallback == "no_lanes" and pl.reservation.lane is None and pl.prediction.push_s > 0


@pytest.mark.parametrize("kw, match", [
    (dict(ps=[]), "prefill and decode"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(nbytes=-1), "bytes"),
    (dict(policy="fastest"), "policy"),
    (dict(ps=[EngineState("p0", "nowhere")]), "prefill.0.host"),
])
def test_bad_input_is_refused_naming_the_field(kw, match):
    svc = _service()
    args = dict(ps=[EngineState("p0", "l0h0")], ds=[EngineState("d0", "l1h0")], prompt_tokens=100, nbytes=MB)
    args.update(kw)
    with pytest.raises((PlacementError, ReservationError), match=match):
        place(svc, _cost(), args["ps"], args["ds"], args["prompt_tokens"], args["nbytes"],
              policy=args.get("policy", "joint"))
    assert not svc.active


@pytest.mark.parametrize("fan", [1, 2])
def test_pruning_equals_the_exhaustive_search_with_worker_pairs_sharing_host_links(fan):
    """Engines whose transfers go over ``fan`` worker pairs (TP ranks: every pair's share
    crosses P's uplink and D's downlink), random loads: the pruned search takes what an
    exhaustive one takes, and costs fewer candidates."""
    from kvpath.reservation.wire import WorkerPair

    hosts_p, hosts_d = [f"l0h{i}" for i in range(4)], [f"l1h{i}" for i in range(4)]
    svc = ReservationService(SPEC, "cc", clock=Clock())
    for a, ph in enumerate(hosts_p):
        for b, dh in enumerate(hosts_d):
            for r in range(fan):
                svc.register_lanes(ph, dh, lanes_covering_spines(ph, dh, n=4, first_port=30000 + 1000 * r + 37 * a + b),
                                   pair=WorkerPair(p_engine=f"pe{a}", d_engine=f"de{b}", p_rank=r, d_rank=r))
    rng = random.Random(11)
    for _ in range(30):
        svc.reserve(rng.choice(hosts_p), rng.choice(hosts_d), rng.randint(1, 400) * MB)
    cost = _cost()
    fewer = False
    for trial in range(15):
        ps = [EngineState(f"p{i}", hosts_p[i], rng.randint(0, 3), rng.randint(0, 40_000), engine_id=f"pe{i}")
              for i in range(4)]
        ds = [EngineState(f"d{j}", hosts_d[j], rng.randint(0, 3), engine_id=f"de{j}") for j in range(4)]
        nbytes, tokens = rng.randint(1, 300) * MB, rng.randint(100, 6000)
        a = place(svc, cost, ps, ds, tokens, nbytes, transfer_id=f"a{trial}")
        svc.release(a.reservation.lease_id)
        b = place(svc, cost, ps, ds, tokens, nbytes, transfer_id=f"b{trial}", exhaustive=True)
        svc.release(b.reservation.lease_id)
        assert (a.p, a.d, a.reservation.lane, a.prediction.ttft_s) == (b.p, b.d, b.reservation.lane, b.prediction.ttft_s)
        fewer |= a.considered < b.considered
    assert fewer


def test_a_pair_without_lanes_loses_a_tie_and_a_pair_on_one_host_pushes_nothing():
    svc = ReservationService(SPEC, "cc", clock=Clock())
    svc.register_lanes("l0h1", "l1h0", lanes_covering_spines("l0h1", "l1h0", n=4))
    ps = [EngineState("p0", "l0h0"), EngineState("p1", "l0h1")]  # p0 -> d0: no lane registered
    pl = place(svc, _cost(), ps, [EngineState("d0", "l1h0")], 100, 1)  # a push too small to tell them apart
    assert pl.p == 1 and pl.reservation.lane is not None
    same = place(svc, _cost(), [EngineState("p", "l1h0")], [EngineState("d", "l1h0")], 100, 100 * MB)
    assert same.prediction.push_s == 0.0


def test_concurrent_placements_over_http_never_take_the_same_free_spine():
    """Eight identical /v1/place calls in flight at once on one P-D pair whose 4 lanes
    cross 4 spines, each with a 200 MB push: every decision sees the reservations of the
    ones before it (the choice and the reservation are one step), so the first four take
    four different spines and the next four the spines with one flow each, evenly."""
    import asyncio
    from collections import Counter

    import httpx

    from kvpath.reservation.app import create_app

    svc = ReservationService(SPEC, "cc", clock=Clock())
    svc.register_lanes("l0h0", "l1h0", lanes_covering_spines("l0h0", "l1h0", n=4))
    app = create_app(svc, token="t0ken", cost=_cost())
    body = {"prefill": [{"name": "p0", "host": "l0h0"}], "decode": [{"name": "d0", "host": "l1h0"}],
            "prompt_tokens": 1000, "bytes": 200 * MB}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://svc",
                                     headers={"Authorization": "Bearer t0ken"}) as c:
            rs = await asyncio.gather(*(c.post("/v1/place", json={**body, "transfer_id": f"c{k}"}) for k in range(8)))
        return [r.json() for r in rs]

    got = asyncio.run(go())
    assert all(a["lease_id"] and a["spine"] for a in got)
    by_spine = Counter(a["spine"] for a in got)
    assert len(by_spine) == 4 and set(by_spine.values()) == {2}
