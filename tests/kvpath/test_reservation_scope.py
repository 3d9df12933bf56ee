"""Which worker pairs a reservation charges: the engines (and ranks) that carry it,
never other engines on the same hosts, nor a D incarnation that is gone."""

import asyncio

import pytest

from kvpath.fabric import FabricSpec
from kvpath.reservation.clients import InProcessReserver
from kvpath.reservation.decisions import ReservationError, ReservationService
from kvpath.reservation.wire import FlowScope, LaneInfo, LanesRequest, ReserveRequest, WorkerPair, encode

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=4, ecmp_seed=3)
SRC, DST = "l0h0", "l1h0"


def ports_on_spines(spines, first=40000):
    """One source port per wanted spine (in order): lane i of a pair goes over spines[i]."""
    out, port = [], first
    for want in spines:
        while SPEC.flow_path(SRC, DST, port, 5000).spine != f"spine{want}":
            port += 1
        out.append(port)
        port += 1
    return out


def lanes_on(spines, first=40000):
    return [LaneInfo(i, p, 5000) for i, p in enumerate(ports_on_spines(spines, first))]


def pair(p="pA", d="dA", pr=0, dr=0, inc="agent-1"):
    return WorkerPair(p_engine=p, d_engine=d, p_rank=pr, d_rank=dr, incarnation=inc)


def spine_flows(svc):
    """Reserved flows on each spine's downlink to leaf1 (each flow crosses one)."""
    return {s: svc.loads.flows.get((f"spine{s}", "leaf1"), 0) for s in range(SPEC.spines)}


def test_a_reservation_scoped_to_two_engines_charges_their_pairs_only():
    svc = ReservationService(SPEC, "cc")
    # engine pair A: lane 0 on spine0, lane 1 on spine1; engine pair B shares the hosts
    # with lane 0 on spine2 and lane 1 on spine3
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair())
    svc.register_lanes(SRC, DST, lanes_on([2, 3], 41000), pair=pair("pB", "dB"))
    r = svc.reserve(SRC, DST, 1000, scope=FlowScope(p_engine="pA", d_engine="dA"))
    assert r.lane == 0 and r.workers == ("pA/r0>dA/r0",) and [p.spine for p in r.paths] == ["spine0"]
    # one flow, on A's path: B's spine2 is not charged (unscoped, both would be)
    assert spine_flows(svc) == {0: 1, 1: 0, 2: 0, 3: 0}
    assert svc.loads.bytes[("l0h0", "leaf0")] == 1000
    # the next A transfer avoids spine0; B's own choice is not blocked by A's load
    assert svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine="pA", d_engine="dA")).paths[0].spine == "spine1"
    b = svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine="pB", d_engine="dB"))
    assert b.lane == 0 and b.paths[0].spine == "spine2" and b.workers == ("pB/r0>dB/r0",)
    assert spine_flows(svc) == {0: 1, 1: 1, 2: 1, 3: 0}


def test_an_unscoped_reservation_is_carried_by_every_pair_of_the_host_pair():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair())
    svc.register_lanes(SRC, DST, lanes_on([2, 3], 41000), pair=pair("pB", "dB"))
    r = svc.reserve(SRC, DST, 1000)
    assert len(r.paths) == 2 and spine_flows(svc) == {0: 1, 1: 0, 2: 1, 3: 0}
    assert r.answer(svc.clock()).workers == ["pA/r0>dA/r0", "pB/r0>dB/r0"]


def test_other_engines_lanes_do_not_limit_the_candidates():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1, 2, 3]), pair=pair())
    svc.register_lanes(SRC, DST, lanes_on([0], 41000), pair=pair("pB", "dB"))  # one lane only
    scope = FlowScope(p_engine="pA", d_engine="dA")
    assert [svc.reserve(SRC, DST, 1, scope=scope).lane for _ in range(4)] == [0, 1, 2, 3]


def test_tp_rank_pairs_are_one_flow_each_and_a_rank_scope_is_one_flow():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair(pr=0, dr=0))
    svc.register_lanes(SRC, DST, lanes_on([2, 3], 41000), pair=pair(pr=1, dr=1, inc="agent-2"))
    # the proxy's scope: both rank pairs, the bytes split between them
    r = svc.reserve(SRC, DST, 1000, scope=FlowScope(p_engine="pA", d_engine="dA"))
    assert r.workers == ("pA/r0>dA/r0", "pA/r1>dA/r1") and spine_flows(svc) == {0: 1, 1: 0, 2: 1, 3: 0}
    assert svc.loads.bytes[("spine0", "leaf1")] == 500 and svc.loads.bytes[("spine2", "leaf1")] == 500
    svc.release(r.lease_id)
    assert svc.loads.total_flows() == 0 and not svc.loads.bytes
    # P's rank 1 at push time: its own flow, all its bytes
    r = svc.reserve(SRC, DST, 700, scope=FlowScope(p_engine="pA", d_engine="dA", p_rank=1, d_rank=1))
    assert r.workers == ("pA/r1>dA/r1",) and spine_flows(svc) == {0: 0, 1: 0, 2: 1, 3: 0}
    assert svc.loads.bytes[("spine2", "leaf1")] == 700


def test_a_scope_no_registered_pair_matches_falls_back():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair())
    r = svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine="pA", d_engine="gone"))
    assert r.fallback == "no_lanes" and svc.loads.total_flows() == 0
    # a pair registered by a free-form name has no engines: only unscoped requests see it
    svc.register_lanes(SRC, DST, lanes_on([2], 41000), worker="legacy")
    assert svc.reserve(SRC, DST, 1, scope=FlowScope(d_engine="dA")).workers == ("pA/r0>dA/r0",)
    assert set(svc.reserve(SRC, DST, 1).workers) == {"legacy", "pA/r0>dA/r0"}


def test_a_restarted_d_replaces_its_pair_and_a_late_removal_of_the_old_one_is_ignored():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair(inc="agent-old"))
    # D restarted: P opens lanes to the new incarnation (other ports) and registers them
    svc.register_lanes(SRC, DST, lanes_on([2, 3], 41000), pair=pair(inc="agent-new"))
    assert svc.state()["worker_pairs"] == 1
    # P forgets the old incarnation later: its removal must not drop the new lanes
    assert svc.unregister_lanes(SRC, DST, pair=pair(inc="agent-old")) == 0
    assert svc.counters["lane_unregistrations_stale"] == 1
    r = svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine="pA", d_engine="dA"))
    assert r.paths[0].spine == "spine2"  # the new incarnation's lane 0, not the dead one's spine0
    assert svc.unregister_lanes(SRC, DST, pair=pair(inc="agent-new")) == 2
    assert svc.state()["worker_pairs"] == 0 and not svc.state()["lanes_known"]


def test_worker_and_pair_that_disagree_are_refused_naming_them():
    svc = ReservationService(SPEC, "cc")
    with pytest.raises(ReservationError, match="worker 'x' and pair"):
        svc.register_lanes(SRC, DST, lanes_on([0]), worker="x", pair=pair())
    svc.register_lanes(SRC, DST, lanes_on([0]), worker="pA/r0>dA/r0", pair=pair())  # the same pair: fine
    with pytest.raises(ReservationError, match="scope"):
        svc.reserve(SRC, DST, 1, scope={"p_engine": "pA"})


def test_the_registry_and_the_scope_cache_are_bounded(monkeypatch):
    import kvpath.reservation.lane_registry as res

    monkeypatch.setattr(res, "MAX_WORKER_PAIRS", 3)
    monkeypatch.setattr(res, "MAX_SCOPES_CACHED", 4)
    svc = ReservationService(SPEC, "cc")
    for i in range(3):
        svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair(p=f"p{i}"))
    with pytest.raises(ReservationError, match="3 worker pairs are registered"):
        svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair(p="p3"))
    svc.register_lanes(SRC, DST, lanes_on([1]), pair=pair(p="p0"))  # re-registering a known pair is fine
    assert svc.counters["lane_registrations_refused"] == 1
    svc.unregister_lanes(SRC, DST, pair=pair(p="p1"))
    svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair(p="p3"))  # room again
    for i in range(20):  # made-up scopes match no pair: nothing is cached for them
        assert svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine=f"x{i}")).fallback == "no_lanes"
    assert svc._cands.get((SRC, DST), {}) == {}
    for i in range(4):  # real ones are cached by the pairs they select, at most MAX_SCOPES_CACHED
        svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine=f"p{i}"))
    svc.reserve(SRC, DST, 1, scope=FlowScope(p_engine="p0", d_engine="dA"))  # the same pairs as p0's
    assert len(svc._cands[(SRC, DST)]) <= 4


def test_the_registry_holds_a_bounded_number_of_lanes(monkeypatch):
    """Lanes over all pairs are bounded too (a pair may name 1,024): a registration past the
    bound is refused, a re-registration counts its new lanes in place of its old ones."""
    import kvpath.reservation.lane_registry as res

    monkeypatch.setattr(res, "MAX_REGISTERED_LANES", 5)
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1, 2]), pair=pair(p="p0"))
    with pytest.raises(ReservationError, match="5 lanes are registered"):
        svc.register_lanes(SRC, DST, lanes_on([0, 1, 2]), pair=pair(p="p1"))
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair(p="p1"))  # 5 in all: fits
    svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair(p="p0"))  # p0 again, with fewer
    assert svc.state()["lanes_registered"] == 3
    svc.unregister_lanes(SRC, DST, pair=pair(p="p1"))
    assert svc.state()["lanes_registered"] == 1


def test_the_proxys_reserver_passes_the_scope_through():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0, 1]), pair=pair())
    svc.register_lanes(SRC, DST, lanes_on([2, 3], 41000), pair=pair("pB", "dB"))
    grant = asyncio.run(InProcessReserver(svc).reserve(SRC, DST, 10, scope=FlowScope(p_engine="pB", d_engine="dB")))
    assert grant.spine == "spine2"
    # and the wire carries it (a scope of defaults is left out)
    body = encode(ReserveRequest(src_host=SRC, dst_host=DST, bytes=1, scope=FlowScope(p_engine="pB", p_rank=0)))
    assert body == b'{"src_host":"l0h0","dst_host":"l1h0","bytes":1,"scope":{"p_engine":"pB","p_rank":0}}'


def test_pairs_not_registered_again_within_the_ttl_are_forgotten():
    clock = [100.0]
    svc = ReservationService(SPEC, "cc", clock=lambda: clock[0], lanes_ttl_s=60.0)
    svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair(p="dead"))  # its P was killed: never again
    svc.register_lanes(SRC, DST, lanes_on([1]), pair=pair(p="live"))
    clock[0] += 40
    svc.register_lanes(SRC, DST, lanes_on([1]), pair=pair(p="live"))  # P's periodic re-registration
    clock[0] += 30  # dead: 70 s old, live: 30 s
    svc.expire()
    assert svc.state()["worker_pairs"] == 1 and svc.lanes(SRC, DST, pair=pair(p="live"))
    assert svc.counters["lane_registrations_expired"] == 1
    with pytest.raises(ReservationError, match="lanes_ttl_s"):
        ReservationService(SPEC, "cc", lanes_ttl_s=0)
    # the simulator registers once and runs simulated hours: an infinite TTL keeps them
    forever = ReservationService(SPEC, "cc", clock=lambda: clock[0], lanes_ttl_s=float("inf"))
    forever.register_lanes(SRC, DST, lanes_on([0]), pair=pair())
    clock[0] += 1e7
    assert forever.reserve(SRC, DST, 1).fallback == "" and forever.state()["worker_pairs"] == 1


def test_a_pair_registered_by_engines_is_neither_overwritten_nor_removed_by_name():
    svc = ReservationService(SPEC, "cc")
    svc.register_lanes(SRC, DST, lanes_on([0]), pair=pair())
    key = pair().key()
    with pytest.raises(ReservationError, match="register it again with its pair"):
        svc.register_lanes(SRC, DST, lanes_on([1]), worker=key)
    assert svc.unregister_lanes(SRC, DST, worker=key) == 0  # by name: not its incarnation
    assert svc.unregister_lanes(SRC, DST, pair=pair(inc="")) == 0
    assert svc.lanes(SRC, DST, pair=pair()) == lanes_on([0])
    assert svc.unregister_lanes(SRC, DST, pair=pair()) == 1


@pytest.mark.parametrize("bad", ["", "a/b", "x>y", "e" * 129])
def test_engine_ids_that_would_make_pair_names_ambiguous_are_refused_on_the_wire(bad):
    import msgspec

    body = {"src_host": SRC, "dst_host": DST, "lanes": [{"lane": 0, "src_port": 1}],
            "pair": {"p_engine": bad, "d_engine": "d"}}
    with pytest.raises(msgspec.ValidationError, match="p_engine"):
        msgspec.json.decode(encode(body), type=LanesRequest)
    assert WorkerPair.engine_id_problem(bad) is not None and WorkerPair.engine_id_problem("p-l0h0") is None
