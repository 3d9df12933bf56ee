"""Decisions of the reservation service on small fabrics (model oracle)."""

import random

import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.oracle import ModelOracle
from kvpath.reservation.decisions import LaneInfo, ReservationError, ReservationService, default_lane
from kvpath.reservation.wire import METRICS, MODES

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=4, ecmp_seed=3)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def lanes_covering_spines(src, dst, n=8, first_port=40000, first_spine=None):
    """n lanes whose source ports hash to every spine (as a P host's lanes would)."""
    out, port, want = [], first_port, list(range(SPEC.spines))
    while len(out) < n:
        sp = int(SPEC.flow_path(src, dst, port, 5000).spine[5:])
        if first_spine is not None and not out and sp != first_spine:
            port += 1
            continue
        if sp in want or not want:
            out.append(LaneInfo(len(out), port, 5000))
            if sp in want:
                want.remove(sp)
        port += 1
    return out


def spine_flows(svc):
    return {k: v for k, v in svc.state()["links"].items() if "spine" in k}


def test_ecmp_takes_the_hash_lane_and_its_hash_path():
    svc = ReservationService(SPEC, "ecmp")
    lanes = lanes_covering_spines("l0h0", "l1h0")
    for i in range(50):
        r = svc.reserve("l0h0", "l1h0", 10_000_000, lanes, transfer_id=f"t{i}")
        assert r.lane == default_lane(f"t{i}", len(lanes))
        assert r.path == SPEC.flow_path("l0h0", "l1h0", lanes[r.lane].src_port, 5000)


def test_cc_never_stacks_flows_on_a_spine_link_while_a_free_one_exists():
    rng = random.Random(5)
    svc = ReservationService(SPEC, "cc")
    srcs = [f"l0h{i}" for i in range(4)]
    dsts = [f"l1h{i}" for i in range(4)]
    lanes = {(s, d): lanes_covering_spines(s, d) for s in srcs for d in dsts}
    active = []
    for step in range(400):
        if active and rng.random() < 0.45:
            svc.release(active.pop(rng.randrange(len(active))).lease_id)
            continue
        s, d = rng.choice(srcs), rng.choice(dsts)
        up = {k: v["flows"] for k, v in spine_flows(svc).items() if k.startswith("leaf0->")}
        least = min(up.get(f"leaf0->spine{i}", 0) for i in range(SPEC.spines))
        r = svc.reserve(s, d, rng.randint(1, 10**8), lanes[(s, d)], transfer_id=f"t{step}")
        assert up.get(f"leaf0->{r.path.spine}", 0) == least, f"step {step}: busier uplink chosen"
        active.append(r)
        if least == 0:  # a free spine link existed: the new flow is alone on its spine links
            assert all(v["flows"] == 1 for k, v in spine_flows(svc).items() if r.path.spine in k)
    for r in active:
        svc.release(r.lease_id)
    assert svc.state()["reserved_flows"] == 0 and svc.state()["links"] == {}


def test_cc_ties_are_broken_by_lowest_lane():
    svc = ReservationService(SPEC, "cc")
    lanes = lanes_covering_spines("l0h0", "l1h0")
    assert svc.reserve("l0h0", "l1h0", 1, lanes).lane == 0
    assert svc.reserve("l0h0", "l1h0", 1, lanes).path.spine != next(iter(svc.active.values())).path.spine


def _sequence(svc, clock, rng, steps=300):
    srcs = [f"l0h{i}" for i in range(4)]
    lanes = {s: lanes_covering_spines(s, "l1h0", first_port=41000 + 100 * i) for i, s in enumerate(srcs)}
    active, decisions = [], []
    for step in range(steps):
        clock.t += rng.random() * 0.01
        if active and rng.random() < 0.4:
            svc.release(active.pop(rng.randrange(len(active))).lease_id)
            continue
        s = rng.choice(srcs)
        r = svc.reserve(s, "l1h0", rng.randint(1, 10**8), lanes[s], transfer_id=f"t{step}")
        active.append(r)
        decisions.append((r.lane, r.path.spine))
    return decisions


def test_dc_with_zero_delay_equals_cc():
    c1, c2 = Clock(), Clock()
    cc = _sequence(ReservationService(SPEC, "cc", clock=c1), c1, random.Random(9))
    dc = _sequence(ReservationService(SPEC, "dc", dc_delay_s=0.0, clock=c2), c2, random.Random(9))
    assert cc == dc


def test_dc_with_a_long_delay_collides_and_heals_once_heard():
    clock = Clock()
    svc = ReservationService(SPEC, "dc", dc_delay_s=1.0, clock=clock)
    a = lanes_covering_spines("l0h0", "l1h0", first_port=42000, first_spine=2)
    b = lanes_covering_spines("l0h1", "l1h1", first_port=43000, first_spine=2)
    r1 = svc.reserve("l0h0", "l1h0", 10**8, a)
    r2 = svc.reserve("l0h1", "l1h1", 10**8, b)
    assert r1.path.spine == r2.path.spine == "spine2"  # neither has heard of the other yet
    assert spine_flows(svc)["leaf0->spine2"]["flows"] == 2
    clock.t += 1.0
    r3 = svc.reserve("l0h2", "l1h2", 10**8, lanes_covering_spines("l0h2", "l1h2", first_port=44000, first_spine=2))
    assert r3.path.spine != "spine2"  # broadcasts arrived: spine2 is known busy
    # cc in the same situation never collides
    cc = ReservationService(SPEC, "cc", clock=Clock())
    assert cc.reserve("l0h0", "l1h0", 10**8, a).path.spine != cc.reserve("l0h1", "l1h1", 10**8, b).path.spine


def test_dc_views_equal_a_recount_of_the_unheard_changes():
    """The dc agents' views are kept incrementally; check them against a recount:
    the true loads minus the other hosts' changes younger than the delay."""
    rng = random.Random(4)
    clock = Clock()
    svc = ReservationService(SPEC, "dc", dc_delay_s=0.03, clock=clock)
    hosts = [f"l0h{h}" for h in range(4)]
    lanes = {h: lanes_covering_spines(h, "l1h0", first_port=46000 + 60 * i) for i, h in enumerate(hosts)}
    core = sorted({ln for h in hosts for c in lanes[h] for ln in SPEC.flow_path(h, "l1h0", c.src_port, 5000).core_links})
    log, active = [], []  # every change (time, origin, links, bytes, sign)
    for i in range(1500):
        clock.t += rng.choice([0.001, 0.004, 0.02])
        if active and rng.random() < 0.45:
            r = active.pop(rng.randrange(len(active)))
            svc.release(r.lease_id)
            log.append((clock.t, r.src_host, r.path.links, r.bytes, -1))
        else:
            h = rng.choice(hosts)
            r = svc.reserve(h, "l1h0", rng.randint(1, 10**6), lanes[h], f"v{i}")
            active.append(r)
            log.append((clock.t, h, r.path.links, r.bytes, +1))
        me = rng.choice(hosts)
        view = svc._view(me, clock.t)
        for ln in core:
            flows = sum(sg for _, _, ls, _, sg in log if ln in ls) - sum(
                sg for t, o, ls, _, sg in log if ln in ls and o != me and t + 0.03 > clock.t)
            nbytes = sum(sg * b for _, _, ls, b, sg in log if ln in ls) - sum(
                sg * b for t, o, ls, b, sg in log if ln in ls and o != me and t + 0.03 > clock.t)
            assert view.cost((ln,)) == (flows, nbytes, nbytes), (i, me, ln)


def test_leases_expire_and_release_is_idempotent():
    clock = Clock()
    svc = ReservationService(SPEC, "cc", lease_s=2.0, clock=clock)
    lanes = lanes_covering_spines("l0h0", "l1h0")
    r = svc.reserve("l0h0", "l1h0", 5, lanes)
    assert svc.state()["reserved_flows"] == 4 and svc.state()["active"] == 1  # one flow on each of 4 links
    clock.t += 2.0
    assert svc.state()["active"] == 0 and svc.state()["reserved_flows"] == 0
    assert svc.release(r.lease_id) is False  # already ended by its lease
    r2 = svc.reserve("l0h0", "l1h0", 5, lanes)
    assert svc.release(r2.lease_id) is True and svc.release(r2.lease_id) is False


def test_burst_of_reserve_release_leaves_no_drift():
    rng = random.Random(1)
    for mode in MODES:
        clock = Clock()
        svc = ReservationService(SPEC, mode, dc_delay_s=0.05, clock=clock)
        lanes = {f"l{l}h{h}": lanes_covering_spines(f"l{l}h{h}", "l1h3" if l == 0 else "l0h3", first_port=45000 + 50 * h)
                 for l in range(2) for h in range(3)}
        active = []
        for i in range(3000):
            clock.t += 0.001
            if active and rng.random() < 0.5:
                svc.release(active.pop(rng.randrange(len(active))).lease_id)
            else:
                s = rng.choice(list(lanes))
                d = "l1h3" if s.startswith("l0") else "l0h3"
                active.append(svc.reserve(s, d, rng.randint(0, 10**9), lanes[s], f"b{i}"))
        for r in active:
            svc.release(r.lease_id)
        st = svc.state()
        assert st["reserved_flows"] == 0 and st["links"] == {} and st["active"] == 0, mode


def test_registered_lanes_are_used_and_missing_lanes_fall_back():
    svc = ReservationService(SPEC, "cc")
    r = svc.reserve("l0h0", "l1h0", 10)
    assert r.lane is None and r.fallback == "no_lanes" and svc.counters["fallback_no_lanes"] == 1
    svc.register_lanes("10.0.2.1", "10.1.2.1", lanes_covering_spines("l0h0", "l1h0"))  # by IP
    r = svc.reserve("l0h0", "l1h0", 10)
    assert r.lane is not None and not r.fallback


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(src_host="l9h0"), "src_host"), (dict(dst_host=""), "dst_host"), (dict(nbytes=-1), "bytes"),
     (dict(lanes=[LaneInfo(0, 1), LaneInfo(0, 2)]), "lane"), (dict(lanes=[LaneInfo(0, 70000)]), "port")],
)
def test_bad_input_names_the_field(kwargs, field):
    svc = ReservationService(SPEC, "cc")
    args = dict(src_host="l0h0", dst_host="l1h0", nbytes=1, lanes=None)
    args.update(kwargs)
    with pytest.raises(ReservationError, match=field):
        svc.reserve(**args)


def test_bad_mode():
    with pytest.raises(ReservationError, match="mode"):
        ReservationService(SPEC, "random")


def test_worker_pairs_of_one_host_pair_never_overwrite_each_other_and_share_a_lane_id():
    # two TP ranks (or two engines on one host) register their own lanes: both stay,
    # and a reservation of lane i loads lane i's path of every pair
    svc = ReservationService(SPEC, mode="cc")
    a = lanes_covering_spines("l0h0", "l1h0")
    b = [LaneInfo(i, ln.src_port, ln.dst_port) for i, ln in enumerate(reversed(a))]
    svc.register_lanes("l0h0", "l1h0", a, worker="p/r0>d0")
    svc.register_lanes("l0h0", "l1h0", b, worker="p/r1>d1")
    assert svc.lanes("l0h0", "l1h0", "p/r0>d0") == sorted(a, key=lambda x: x.lane)
    assert svc.lanes("l0h0", "l1h0", "p/r1>d1") == b
    r = svc.reserve("l0h0", "l1h0", 1000)
    spines = {p.spine for p in r.paths}
    assert len(r.paths) == 2 and r.path == r.paths[0]
    want = {svc.oracle.path("l0h0", "l1h0", a[r.lane].src_port, a[r.lane].dst_port).spine,
            svc.oracle.path("l0h0", "l1h0", b[r.lane].src_port, b[r.lane].dst_port).spine}
    assert spines == want
    # the bytes are split between the two pairs: each host uplink carries 500 per pair
    assert svc.loads.bytes[("l0h0", "leaf0")] == 1000 and svc.loads.flows[("l0h0", "leaf0")] == 2
    svc.release(r.lease_id)
    assert svc.loads.total_flows() == 0 and not any(svc.loads.bytes.values())
    # a pair that re-registers (a lane reopened) replaces only its own lanes
    svc.register_lanes("l0h0", "l1h0", a[:1], worker="p/r1>d1")
    assert len(svc.lanes("l0h0", "l1h0", "p/r0>d0")) == len(a)
    r = svc.reserve("l0h0", "l1h0", 10)  # only lane 0 is common to both pairs now
    assert r.lane == 0


def test_lease_ids_cannot_be_guessed_from_one_another():
    svc = ReservationService(SPEC, "cc")
    lanes = lanes_covering_spines("l0h0", "l1h0")
    a, b = (svc.reserve("l0h0", "l1h0", 1, lanes).lease_id for _ in range(2))
    assert a.startswith("r1-") and b.startswith("r2-") and a[3:] != b[3:]
    assert not svc.release("r2") and not svc.release(b[:-1] + ("0" if b[-1] != "0" else "1"))
    assert svc.release(b)


def test_the_bytes_metric_puts_a_push_beside_many_small_ones_rather_than_one_big_one():
    """cc with metric=bytes weighs reserved bytes on a path's busiest link; with
    metric=flows it counts flows. One 100 MB push on spine0 and two 1 MB pushes on
    spine1: flows sends the next push to spine0, bytes to spine1."""
    spec = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2)
    oracle = ModelOracle(spec)
    by_spine: dict[str, int] = {}
    for port in range(40000, 40200):
        by_spine.setdefault(oracle.path("l0h0", "l1h0", port, KV_SIDE_CHANNEL_PORT).spine, port)
    lanes = [LaneInfo(0, by_spine["spine0"], KV_SIDE_CHANNEL_PORT), LaneInfo(1, by_spine["spine1"], KV_SIDE_CHANNEL_PORT)]
    picks = {}
    for metric in METRICS:
        svc = ReservationService(spec, "cc", oracle=oracle, metric=metric)
        svc.register_lanes("l0h0", "l1h0", lanes)
        svc.reserve("l0h0", "l1h0", 100_000_000, [lanes[0]], "big")
        svc.reserve("l0h0", "l1h0", 1_000_000, [lanes[1]], "s1")
        svc.reserve("l0h0", "l1h0", 1_000_000, [lanes[1]], "s2")
        picks[metric] = svc.reserve("l0h0", "l1h0", 1_000_000, transfer_id="next").path.spine
    assert picks == {"flows": "spine0", "bytes": "spine1"}
    with pytest.raises(ReservationError, match="metric"):
        ReservationService(spec, "cc", metric="packets")


def test_one_service_per_group_of_leaves_decides_as_one_service_for_all():
    """Sharding by pod (docs/reservation.md, "Past one process"): pairs inside one group
    of leaves use no link of another group's pairs, so a service that sees only its
    group's reservations decides every one of them as a service that sees all."""
    spec = FabricSpec(leaves=4, spines=4, hosts_per_leaf=4)
    groups = [[spec.host_name(leaf, h) for leaf in leaves for h in range(4)] for leaves in ((0, 1), (2, 3))]
    links = [{ln for s in g for d in g for sp in range(spec.spines) for ln in spec.path(s, d, sp).links}
             for g in groups]
    assert links[0] and not links[0] & links[1]
    lanes = [LaneInfo(i, 40000 + 7 * i) for i in range(8)]
    whole, shards = ReservationService(spec, "cc"), [ReservationService(spec, "cc") for _ in groups]
    rng = random.Random(3)
    live: list[tuple[int, str, str]] = []
    decided = 0
    for k in range(600):
        g = rng.randrange(2)
        s, d = rng.sample(groups[g], 2)
        for svc in (whole, shards[g]):
            if not svc.lanes(s, d):
                svc.register_lanes(s, d, lanes)
        nbytes = rng.randint(1, 10**9)
        a = whole.reserve(s, d, nbytes, transfer_id=f"t{k}")
        b = shards[g].reserve(s, d, nbytes, transfer_id=f"t{k}")
        assert a.lane == b.lane, k
        decided += s[:2] != d[:2]  # across leaves: through a spine, a real choice
        live.append((g, a.lease_id, b.lease_id))
        if len(live) > 24:  # flows end, in the same order in both
            g0, la, lb = live.pop(rng.randrange(len(live)))
            whole.release(la)
            shards[g0].release(lb)
    assert decided > 300
