"""The flow-level network model against what max-min fair sharing must give."""

import numpy as np
import pytest

from kvpath.fabric import FabricSpec
from kvpath.bridge import flow_model as fm
from kvpath.bridge.flow_model import FlowModel, FlowSpec, NetParams, max_min_rates, trivial_fct

SPEC = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2, host_link_gbps=100.0, spine_link_gbps=100.0)
RATE = 100e9 / 8  # bytes/s
MB100 = 100_000_000


def test_one_flow_alone_takes_size_over_rate():
    fct = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", MB100, 1.0, spine=0)])
    assert fct[0] == pytest.approx(MB100 / RATE, rel=1e-9)


def test_two_flows_on_one_spine_take_twice_as_long_and_split_take_the_same():
    same = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", MB100, 0.0, 0), FlowSpec("l0h1", "l1h1", MB100, 0.0, 0)])
    split = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", MB100, 0.0, 0), FlowSpec("l0h1", "l1h1", MB100, 0.0, 1)])
    assert same == pytest.approx([2 * MB100 / RATE] * 2, rel=1e-9)
    assert split == pytest.approx([MB100 / RATE] * 2, rel=1e-9)


def test_a_late_flow_shares_only_while_both_run():
    # B starts when A is half done: A's second half and B's first half share (rate/2),
    # then B finishes alone
    t = MB100 / RATE
    fct = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", MB100, 0.0, 0), FlowSpec("l0h1", "l1h1", MB100, t / 2, 0)])
    assert fct[0] == pytest.approx(t / 2 + t, rel=1e-9)  # half alone, half at rate/2
    assert fct[1] == pytest.approx(t + t / 2, rel=1e-9)  # half at rate/2 (t), half alone (t/2)


def test_max_min_gives_the_unbottlenecked_flow_the_rest():
    # links 0 and 1 of capacity 10; flows: A on {0}, B on {0, 1}, C on {1}, D on {1}
    links = np.array([[0, -1], [0, 1], [1, -1], [1, -1]])
    r = max_min_rates(links, np.array([10.0, 9.0]))
    assert r == pytest.approx([7.0, 3.0, 3.0, 3.0])


def test_no_flow_ends_before_start_plus_size_over_rate():
    rng = np.random.default_rng(0)
    hosts = ["l0h0", "l0h1", "l1h0", "l1h1"]
    flows = []
    for _ in range(200):
        a, b = rng.choice(4, 2, replace=False)
        flows.append(FlowSpec(hosts[a], hosts[b], int(rng.integers(1e5, 1e8)), float(rng.random()), int(rng.integers(2))))
    fct = FlowModel(SPEC).run(flows)
    alone = trivial_fct(SPEC, flows)
    assert np.all(fct >= alone * (1 - 1e-9)) and np.any(fct > alone * 1.5)


def test_overhead_efficiency_and_burst():
    p = NetParams(overhead_s=0.002, efficiency=0.5, burst_bytes=1_000_000)
    f = [FlowSpec("l0h0", "l1h0", MB100, 0.0, 1)]
    want = 0.002 + (MB100 - 1_000_000) / (RATE * 0.5)
    assert FlowModel(SPEC, p).run(f)[0] == pytest.approx(want, rel=1e-9)
    assert trivial_fct(SPEC, f, p)[0] == pytest.approx(want, rel=1e-9)


def test_a_flow_across_the_spines_needs_its_spine():
    with pytest.raises(ValueError, match="give its spine"):
        FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", 1, 0.0, None)])


def test_decisions_see_exactly_the_flows_that_ended_before_them():
    # a least-loaded chooser on the simulated clock: the 2nd flow (starts while the 1st
    # runs) goes to the other spine; the 3rd starts after both ended and takes spine 0
    t = MB100 / RATE
    flows = [FlowSpec("l0h0", "l1h0", MB100, 0.0), FlowSpec("l0h1", "l1h1", MB100, t / 2),
             FlowSpec("l0h0", "l1h1", MB100, 5 * t)]
    busy: dict[int, int] = {}
    chosen, ended = {}, []

    def decide(i, now):
        spine = min(range(2), key=lambda s: (busy.get(s, 0), s))
        busy[spine] = busy.get(spine, 0) + 1
        chosen[i] = spine
        return spine

    def on_end(i, now):
        busy[chosen[i]] -= 1
        ended.append((i, now))

    fct = FlowModel(SPEC).run(flows, decide=decide, on_end=on_end)
    assert chosen == {0: 0, 1: 1, 2: 0}
    assert fct == pytest.approx([t, t, t], rel=1e-9)  # host links differ, spines split: nobody shares
    assert [i for i, _ in ended] == [0, 1, 2] and ended[0][1] == pytest.approx(t)


def _progressive_filling(links: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Textbook progressive filling: every unfrozen flow grows by the smallest fair
    share; the flows of the links that saturate freeze. One bottleneck level a round."""
    n = links.shape[0]
    rate = np.where((links >= 0).any(axis=1), 0.0, np.inf)
    cap = capacity.astype(float).copy()
    active = [i for i in range(n) if (links[i] >= 0).any()]
    while active:
        count = {}
        for i in active:
            for l in links[i][links[i] >= 0]:
                count[l] = count.get(l, 0) + 1
        level = min(cap[l] / c for l, c in count.items())
        full = {l for l, c in count.items() if cap[l] / c <= level * (1 + 1e-12)}
        for i in active:
            rate[i] += level
        for l, c in count.items():
            cap[l] -= level * c
        active = [i for i in active if not full.intersection(links[i][links[i] >= 0].tolist())]
    return rate


def test_max_min_matches_textbook_progressive_filling():
    rng = np.random.default_rng(7)
    for trial in range(30):
        n_links, n_flows = int(rng.integers(3, 40)), int(rng.integers(1, 120))
        capacity = rng.choice([1.0, 2.5, 10.0, 40.0], size=n_links) * rng.uniform(0.5, 1.5, n_links)
        links = np.full((n_flows, 4), -1, dtype=np.int64)
        for i in range(n_flows):
            k = int(rng.integers(0, min(4, n_links) + 1))  # 0-4 links; a flow with none is unconstrained
            links[i, :k] = rng.choice(n_links, size=k, replace=False)
        got, want = max_min_rates(links, capacity), _progressive_filling(links, capacity)
        assert np.array_equal(np.isinf(got), np.isinf(want)), trial
        fin = np.isfinite(want)
        assert np.allclose(got[fin], want[fin], rtol=1e-9), trial
        # feasible, and every flow has a saturated link where it gets the largest rate
        for l in range(n_links):
            on = (links == l).any(axis=1)
            assert got[on].sum() <= capacity[l] * (1 + 1e-9)
        for i in np.flatnonzero(fin):
            mine = links[i][links[i] >= 0]
            assert any(got[(links == l).any(axis=1)].sum() >= capacity[l] * (1 - 1e-9)
                       and got[i] >= got[(links == l).any(axis=1)].max() * (1 - 1e-9) for l in mine), trial


# ---- token buckets: one per directed link, as the testbed's tbf qdiscs -------------
B = 1_000_000  # bucket depth (bytes)
S = 10_000_000


def bucket_model() -> FlowModel:
    return FlowModel(SPEC, NetParams(burst_bytes=B))


def test_flows_that_share_a_link_share_its_one_bucket():
    # two flows leave l0h0 together: its uplink's bucket lets B through once, not once
    # per flow (a per-flow burst would end both at (2S - 2B) / rate)
    fct = bucket_model().run([FlowSpec("l0h0", "l1h0", S, 0.0, 0), FlowSpec("l0h0", "l1h1", S, 0.0, 1)])
    assert fct == pytest.approx([(2 * S - B) / RATE] * 2, rel=1e-9)


def test_a_flow_right_behind_another_finds_the_bucket_empty_and_one_after_a_gap_finds_the_gap_refilled():
    t1 = (S - B) / RATE  # the first flow alone
    back_to_back = bucket_model().run([FlowSpec("l0h0", "l1h0", S, 0.0, 0), FlowSpec("l0h0", "l1h0", S, t1, 0)])
    assert back_to_back == pytest.approx([t1, S / RATE], rel=1e-9)
    gap = 0.4 * B / RATE  # refills 0.4 B
    later = bucket_model().run([FlowSpec("l0h0", "l1h0", S, 0.0, 0), FlowSpec("l0h0", "l1h0", S, t1 + gap, 0)])
    assert later[1] == pytest.approx((S - 0.4 * B) / RATE, rel=1e-9)
    apart = bucket_model().run([FlowSpec("l0h0", "l1h0", S, 0.0, 0), FlowSpec("l0h0", "l1h0", S, t1 + 2 * B / RATE, 0)])
    assert apart[1] == pytest.approx(t1, rel=1e-9)  # a full bucket again, never more


def test_a_bucket_is_per_link_flows_on_disjoint_links_each_get_one():
    fct = bucket_model().run([FlowSpec("l0h0", "l1h0", S, 0.0, 0), FlowSpec("l0h1", "l1h1", S, 0.0, 1)])
    assert fct == pytest.approx([(S - B) / RATE] * 2, rel=1e-9)
    # a flow smaller than the bucket passes at the burst speed, LINE_X times the rate
    small = bucket_model().run([FlowSpec("l0h0", "l1h0", B // 2, 0.0, 0)])
    assert small[0] == pytest.approx(B / 2 / (RATE * fm.LINE_X), rel=1e-9)


def test_a_lanes_first_flow_pays_cold_s_on_top_in_every_backend():
    p = NetParams(overhead_s=0.002, cold_s=0.005)
    warm, cold = FlowSpec("l0h0", "l1h0", MB100, 0.0, 0), FlowSpec("l0h1", "l1h1", MB100, 0.0, 1, cold=True)
    for fct in (FlowModel(SPEC, p).run([warm, cold]), trivial_fct(SPEC, [warm, cold], p)):
        assert fct == pytest.approx([0.002 + MB100 / RATE, 0.007 + MB100 / RATE], rel=1e-9)
    with pytest.raises(ValueError, match="cold_s"):
        NetParams(cold_s=-0.001)


# ---- connections: pushes on one lane share its TCP stream ----------------------------
def test_flows_on_one_connection_get_one_share_of_the_link_between_them():
    # a1 and a2 on connection 0, b on connection 1, all through l0h0's uplink: the
    # connections split the link, a1 and a2 split connection 0's half
    flows = [FlowSpec("l0h0", "l1h0", MB100, 0.0, 0, conn=0), FlowSpec("l0h0", "l1h0", MB100, 0.0, 0, conn=0),
             FlowSpec("l0h0", "l1h1", 2 * MB100, 0.0, 1, conn=1)]
    assert FlowModel(SPEC).run(flows) == pytest.approx([4 * MB100 / RATE] * 3, rel=1e-9)
    # without connections the three would split the link three ways
    alone = FlowModel(SPEC).run([FlowSpec(f.src, f.dst, f.bytes, f.start_s, f.spine) for f in flows])
    assert alone == pytest.approx([3 * MB100 / RATE, 3 * MB100 / RATE, 4 * MB100 / RATE], rel=1e-9)


def test_a_small_flow_behind_a_big_one_on_its_connection_completes_with_it_not_before():
    big, small = 9 * MB100, MB100
    fct = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", big, 0.0, 0, conn=7),
                               FlowSpec("l0h0", "l1h0", small, 0.0, 0, conn=7)])
    # the small one's bytes are through at 2 small / rate, but a lane completes in order
    assert fct == pytest.approx([(big + small) / RATE] * 2, rel=1e-9)
    # a flow that starts after the connection went idle is not held
    later = FlowModel(SPEC).run([FlowSpec("l0h0", "l1h0", small, 0.0, 0, conn=7),
                                 FlowSpec("l0h0", "l1h0", small, 5 * small / RATE, 0, conn=7)])
    assert later == pytest.approx([small / RATE] * 2, rel=1e-9)
