"""P's pushes at its NIC in the simulation (flow_model.UplinkGate, ServingConfig.uplink_pushes):
at most N whole pushes in flight per P host, the waiting ones in fifo or srpt order, each
waiting at most its bound; layer-wise pieces never wait; only the closed-loop backend runs it."""

import numpy as np
import pytest

from kvpath.bridge.flow_model import FlowModel, FlowSpec, UplinkGate
from kvpath.bridge.serving_sim import ServingConfig, simulate
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.workloads import load_workload

SPEC = FabricSpec(leaves=3, spines=2, hosts_per_leaf=2, host_link_gbps=100.0, spine_link_gbps=100.0)
RATE = 100e9 / 8
MB = 1_000_000


def _flows(sizes, starts=None):
    """Pushes from l0h0 to hosts on other leaves, on different spines where they can: only
    P's uplink is shared."""
    dsts = [("l1h0", 0), ("l2h0", 1), ("l1h1", 1), ("l2h1", 0)]
    starts = starts or [0.0] * len(sizes)
    return [FlowSpec("l0h0", dsts[k][0], s, t, dsts[k][1]) for k, (s, t) in enumerate(zip(sizes, starts))]


def _gate(n, slots=1, order="fifo", max_wait_s=float("inf"), gated=None):
    return UplinkGate(np.zeros(n, dtype=int), np.ones(n, dtype=bool) if gated is None else np.array(gated), slots,
                      order, max_wait_s)


def test_one_slot_sends_the_pushes_one_after_another_in_arrival_order():
    flows = _flows([30 * MB, 10 * MB, 20 * MB], [0.0, 1e-6, 2e-6])
    waited = np.zeros(3)
    fct = FlowModel(SPEC).run(flows, gate=_gate(3), waited=waited)
    alone = np.array([30, 10, 20]) * MB / RATE
    ends = np.array([f.start_s for f in flows]) + fct
    assert ends == pytest.approx(np.cumsum(alone), rel=1e-6)  # each alone on the uplink, in turn
    assert waited == pytest.approx([0.0, alone[0] - 1e-6, alone[0] + alone[1] - 2e-6], rel=1e-6)
    # without the gate all three share the uplink and the first ends last
    free = FlowModel(SPEC).run(flows)
    assert free[0] > free[1] and free[0] > fct[0]


def test_srpt_gives_a_freed_slot_to_the_fewest_bytes():
    flows = _flows([30 * MB, 10 * MB, 20 * MB, 5 * MB], [0.0, 1e-6, 2e-6, 3e-6])
    fct = FlowModel(SPEC).run(flows, gate=_gate(4, order="srpt"))
    ends = np.array([f.start_s for f in flows]) + fct
    assert list(np.argsort(ends)) == [0, 3, 1, 2]  # the first holds the slot; then 5, 10, 20 MB
    fifo = FlowModel(SPEC).run(flows, gate=_gate(4, order="fifo"))
    assert list(np.argsort(np.array([f.start_s for f in flows]) + fifo)) == [0, 1, 2, 3]


def test_two_slots_let_two_share_and_the_third_waits():
    flows = _flows([20 * MB, 20 * MB, 20 * MB])
    waited = np.zeros(3)
    fct = FlowModel(SPEC).run(flows, gate=_gate(3, slots=2), waited=waited)
    t2 = 2 * 20 * MB / RATE  # two sharing the uplink end together
    assert fct[:2] == pytest.approx([t2, t2], rel=1e-6)
    assert waited[2] == pytest.approx(t2, rel=1e-6) and fct[2] == pytest.approx(t2 + 20 * MB / RATE, rel=1e-6)


def test_a_push_waits_at_most_its_bound_and_pieces_never_wait():
    flows = _flows([50 * MB, 10 * MB, 10 * MB], [0.0, 0.0, 0.0])
    bound = 1e-3
    waited = np.zeros(3)
    FlowModel(SPEC).run(flows, gate=_gate(3, max_wait_s=bound), waited=waited)
    assert waited[0] == 0.0 and waited[1:] == pytest.approx([bound, bound])  # 50 MB take 4 ms: both go at 1 ms
    waited = np.zeros(3)
    FlowModel(SPEC).run(flows, gate=_gate(3, gated=[True, False, False]), waited=waited)
    assert not waited.any()


def test_a_push_that_went_at_its_bound_holds_no_slot():
    """A (15 MB) holds the one slot; B (100 MB) waits its 1 ms bound and goes beside it;
    C (5 MB) arrives at 1.1 ms and waits. A ends at 1.4 ms (2.5 MB left at 1 ms, at half
    the rate beside B): its slot goes to C then, not when B ends, as in the connector."""
    flows = _flows([15 * MB, 100 * MB, 5 * MB], [0.0, 0.0, 1.1e-3])
    waited = np.zeros(3)
    FlowModel(SPEC).run(flows, gate=_gate(3, max_wait_s=1e-3), waited=waited)
    assert waited == pytest.approx([0.0, 1e-3, 0.3e-3], rel=1e-6, abs=1e-9)


def test_a_bad_gate_is_refused_naming_its_fields():
    with pytest.raises(ValueError, match="slots"):
        _gate(1, slots=0)
    with pytest.raises(ValueError, match="order"):
        _gate(1, order="lifo")


ITM = IterationTimeModel.preset()
SLOW = FabricSpec(leaves=4, spines=4, hosts_per_leaf=4, host_link_gbps=20.0, spine_link_gbps=20.0)


@pytest.fixture(scope="module")
def reqs():
    return list(load_workload("zipf", n=200, qps=30.0, seed=1, min_prompt=1024, max_prompt=4096, pd_ratio=20).requests)


def test_the_serving_simulation_keeps_one_push_per_p_uplink_on_the_wire(reqs):
    """uplink_pushes=1 with a bound longer than any wait: no two pushes of one P host are
    on the wire at once, and some pushes left P after their prefill ended (they waited)."""
    cfg = ServingConfig(pools=(4, 4), mode="cc", uplink_pushes=1, push_order="srpt", push_queue_max_wait_s=10.0)
    tr, _ = simulate(SLOW, reqs, cfg, ITM)
    free, _ = simulate(SLOW, reqs, ServingConfig(pools=(4, 4), mode="cc"), ITM)
    by_p: dict[str, list[tuple[float, float]]] = {}
    waited = 0
    for q in tr.requests:
        assert q.prefill_end_s <= q.push_start_s <= q.push_end_s <= q.first_token_s
        by_p.setdefault(q.p_instance, []).append((q.push_start_s, q.push_end_s))
        waited += q.push_start_s > q.prefill_end_s + 1e-9
    for spans in by_p.values():
        spans.sort()
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert waited > 10
    assert not any(q.push_start_s > q.prefill_end_s + 1e-9 for q in free.requests)  # uncapped: none waits


def test_the_cap_needs_the_closed_loop_backend():
    for backend in ("trivial", "ns3"):
        with pytest.raises(ValueError, match="uplink_pushes"):
            ServingConfig(uplink_pushes=2, backend=backend).validate(SLOW)
    with pytest.raises(ValueError, match="push_order"):
        ServingConfig(uplink_pushes=2, push_order="lifo").validate(SLOW)
