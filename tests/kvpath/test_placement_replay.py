"""Replaying placements: a service's log (decisions, the lane registry's changes, the cost
model) replays every placement's P, D and lane through the placer, and a log that lost
what a placement saw does not."""

import itertools
import random

import pytest
from fastapi.testclient import TestClient

from kvpath.placement import CostModel, EngineState, PlacementError
from kvpath.reservation.app import create_app
from kvpath.reservation.decisions import ReservationService
from kvpath.reservation.lane_log import LaneLog
from kvpath.reservation.placer import place
from kvpath.reservation.replay import ReplayError, replay
from kvpath.reservation.wire import WorkerPair
from tests.kvpath.test_placement import ITM, MB
from tests.kvpath.test_reservation import SPEC, Clock, lanes_covering_spines

P_HOSTS = [f"l0h{i}" for i in range(3)]
D_HOSTS = [f"l1h{i}" for i in range(4)]


def _register(svc, a, ph, b, dh, first_port=30000):
    svc.register_lanes(ph, dh, lanes_covering_spines(ph, dh, n=4, first_port=first_port + 53 * a + 7 * b),
                       pair=WorkerPair(p_engine=f"pe{a}", d_engine=f"de{b}", incarnation="i0"))


def _run(mode="cc", granularity="request", seed=3, steps=240, window=None):
    """Placements under every policy, plain reservations, updates, releases, and lanes that
    come and go (a D restarts with new ports; another is unregistered, then back; every P
    registers all its lanes again, unchanged, now and then)."""
    clock = Clock()
    svc = ReservationService(SPEC, mode, clock=clock)
    if window is not None:
        svc.lane_log = LaneLog(max_lanes=window)
    cost = CostModel(SPEC, ITM, granularity=granularity)
    for (a, ph), (b, dh) in itertools.product(enumerate(P_HOSTS), enumerate(D_HOSTS)):
        _register(svc, a, ph, b, dh)
    rng = random.Random(seed)
    active = []
    for step in range(steps):
        clock.t += rng.random() * 0.01
        if step == 80:  # D 1 restarts: new lanes replace its old ones
            for a, ph in enumerate(P_HOSTS):
                _register(svc, a, ph, 1, D_HOSTS[1], first_port=45000)
        if step == 120:  # D 3 goes away, comes back at step 170
            for a, ph in enumerate(P_HOSTS):
                svc.unregister_lanes(ph, D_HOSTS[3], pair=WorkerPair(p_engine=f"pe{a}", d_engine="de3",
                                                                      incarnation="i0"))
        if step == 170:
            for a, ph in enumerate(P_HOSTS):
                _register(svc, a, ph, 3, D_HOSTS[3], first_port=47000)
        if step % 60 == 30:  # P's minutely refresh: the same lanes again (D 3 is away at 150)
            for (a, ph), (b, dh) in itertools.product(enumerate(P_HOSTS), enumerate(D_HOSTS)):
                if not (b == 3 and 120 <= step < 170):
                    _register(svc, a, ph, b, dh, first_port=45000 if b == 1 and step > 80 else
                              47000 if b == 3 and step > 170 else 30000)
        x = rng.random()
        if active and x < 0.35:
            svc.release(active.pop(rng.randrange(len(active))).lease_id)
        elif active and x < 0.45:
            svc.update(rng.choice(active).lease_id, rng.randint(1, 500) * MB)
        elif x < 0.55:
            ph = rng.choice(P_HOSTS)
            active.append(svc.reserve(ph, rng.choice(D_HOSTS), rng.randint(1, 300) * MB, transfer_id=f"r{step}"))
        else:
            ps = [EngineState(f"p{i}", h, rng.randint(0, 4), rng.randint(0, 50_000), engine_id=f"pe{i}")
                  for i, h in enumerate(P_HOSTS)]
            ds = [EngineState(f"d{j}", h, rng.randint(0, 6), engine_id=f"de{j}") for j, h in enumerate(D_HOSTS)]
            pl = place(svc, cost, ps, ds, rng.randint(100, 6000), rng.randint(1, 400) * MB, f"t{step}",
                       rng.choice(["joint", "joint", "network", "load"]), guard=rng.choice([2, 4]))
            active.append(pl.reservation)
    return svc, cost


def _log(svc, cost):
    return list(svc.decisions), svc.lane_log.events(), cost.to_dict()


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_every_placement_replays_to_its_p_d_and_lane_in_its_own_mode_and_as_dc_with_zero_delay(granularity):
    decisions, lanes, model = _log(*_run(granularity=granularity))
    placed = sum(bool(d.get("placement")) for d in decisions)
    assert placed > 80 and len(decisions) - placed > 10
    assert {d["placement"]["policy"] for d in decisions if d.get("placement")} == {"joint", "network", "load"}
    assert any(e["lanes"] is None for e in lanes)  # the log has the unregistrations
    # and the placements that found no lane for the pair they chose (D 3 while it was away)
    assert any(d["lane"] is None and d["lease_id"] == "" for d in decisions if d.get("placement"))
    for mode in ("cc", "dc"):
        r = replay(decisions, SPEC, mode, 0.0, lanes=lanes, cost_model=model)
        assert (r.placements, r.same_placement, r.differing_placements) == (placed, placed, [])
        assert (r.decisions, r.same_lane) == (len(decisions), len(decisions))


def test_the_lane_log_is_bounded_and_says_from_when_it_knows_the_registry():
    """A window of 25 lanes (five registrations of 4 lanes): the older changes fold into a
    base (one registration per pair still registered); the placements made since the last
    folded change replay to their P, D and lane, the older ones are replayed on their
    logged lanes and counted unverified, not guessed; an unchanged re-registration is not
    a change."""
    svc, cost = _run(window=25)
    ll, n_pairs = svc.lane_log, len(P_HOSTS) * len(D_HOSTS)
    assert ll.weight <= 25 and len(ll.base) <= n_pairs and ll.complete_from_seq > 0
    ev = ll.events()
    assert [e["seq"] for e in ev] == sorted(e["seq"] for e in ev)
    # the changes: 12 first registrations, 3 restarts, 3 removals, 3 returns (no refreshes)
    assert len(_run()[0].lane_log.window) == n_pairs + 9
    decisions = list(svc.decisions)
    placed = [d for d in decisions if d.get("placement")]
    old = sum(d["seq"] <= ll.complete_from_seq for d in placed)
    assert 0 < old < len(placed) - 20
    r = replay(decisions, SPEC, "cc", lanes=ev, cost_model=cost.to_dict(), lanes_complete_from_seq=ll.complete_from_seq)
    assert (r.placements_unverified, r.placements, r.same_placement) == (old, len(placed) - old, len(placed) - old)
    assert r.same_lane == len(decisions) - old  # every other decision, reserve or placement, the same


def test_a_lane_log_window_holds_lanes_not_changes():
    """A caller alternating two large lane sets grows the window to its bound in lanes."""
    log = LaneLog(max_lanes=10_000)
    for k in range(100):
        lanes = tuple((i, 40000 + i + k % 2, 5000, "tcp", "spine0") for i in range(1024))
        log.record({"seq": k, "at": 0.0, "src_host": "a", "dst_host": "b", "worker": "w", "pair": None,
                    "lanes": lanes})
    assert log.weight <= 10_000 and len(log.window) == 9 and len(log.base) == 1 and log.complete_from_seq == 90


def test_a_placement_replays_only_with_what_it_saw():
    decisions, lanes, model = _log(*_run())
    with pytest.raises(ReplayError, match="lane registry"):
        replay(decisions, SPEC, "cc")
    # without D 3's return, the placements that chose it cannot choose it again
    gone = [e for e in lanes if not (e["dst_host"] == D_HOSTS[3] and e["lanes"] and e["lanes"][0][1] >= 47000)]
    assert len(gone) < len(lanes)
    r = replay(decisions, SPEC, "cc", lanes=gone, cost_model=model)
    assert r.same_placement < r.placements and r.differing_placements
    # nor, without its departure, those made while it was away
    stayed = [e for e in lanes if e["lanes"] is not None]
    away = replay(decisions, SPEC, "cc", lanes=stayed, cost_model=model)
    assert away.same_placement < away.placements
    # another cost model (P's prefill 100x slower) weighs P's queue otherwise
    slow = dict(model, time_scale=100.0)
    assert replay(decisions, SPEC, "cc", lanes=lanes, cost_model=slow).same_placement < r.placements
    # a record that lost its engines' states is refused, not guessed
    i = next(k for k, d in enumerate(decisions) if d.get("placement"))
    decisions[i] = dict(decisions[i], placement=dict(decisions[i]["placement"], engines=None))
    with pytest.raises(ReplayError, match="engine states"):
        replay(decisions, SPEC, "cc", lanes=lanes, cost_model=model)


def test_the_cost_model_round_trips_and_a_bad_field_is_named():
    cost = CostModel(SPEC, ITM, max_batch_tokens=4096, time_scale=4.0, granularity="layer", layer_group=2)
    assert CostModel.from_dict(SPEC, cost.to_dict()) == cost
    with pytest.raises(PlacementError, match="colour"):
        CostModel.from_dict(SPEC, dict(cost.to_dict(), colour="red"))
    with pytest.raises(PlacementError, match="iteration_time"):
        CostModel.from_dict(SPEC, dict(cost.to_dict(), iteration_time={"mfu": 7}))


def test_the_http_log_carries_the_registry_and_the_model_and_replays():
    clock = Clock()
    svc = ReservationService(SPEC, "cc", clock=clock)
    cost = CostModel(SPEC, ITM)
    c = TestClient(create_app(svc, token="t0ken", cost=cost))
    h = {"Authorization": "Bearer t0ken"}
    for (a, ph), (b, dh) in itertools.product(enumerate(P_HOSTS[:2]), enumerate(D_HOSTS[:2])):
        lanes = [{"lane": ln.lane, "src_port": ln.src_port, "dst_port": ln.dst_port}
                 for ln in lanes_covering_spines(ph, dh, n=4, first_port=30000 + 53 * a + 7 * b)]
        assert c.post("/v1/lanes", headers=h, json={"src_host": ph, "dst_host": dh, "lanes": lanes,
                                                     "pair": {"p_engine": f"pe{a}", "d_engine": f"de{b}"}}).status_code == 200
    for k in range(12):
        body = {"prefill": [{"name": f"p{i}", "host": P_HOSTS[i], "queued_tokens": 3000 * ((i + k) % 3),
                             "engine_id": f"pe{i}"} for i in range(2)],
                "decode": [{"name": f"d{j}", "host": D_HOSTS[j], "outstanding": (j + k) % 4, "engine_id": f"de{j}"}
                           for j in range(2)],
                "prompt_tokens": 500 + 100 * k, "bytes": (20 + k) * MB, "transfer_id": f"h{k}"}
        assert c.post("/v1/place", headers=h, json=body).status_code == 200
    assert c.get("/v1/decisions").status_code in (401, 403)
    log = c.get("/v1/decisions", headers=h).json()
    assert len(log["decisions"]) == 12 and len(log["lanes"]) == 4 and log["cost_model"] == cost.to_dict()
    r = replay(log["decisions"], SPEC, "cc", lanes=log["lanes"], cost_model=log["cost_model"])
    assert (r.placements, r.same_placement) == (12, 12)
