"""The two-phase P/D serving simulation: causality, mode invariants, decisions."""

import numpy as np
import pytest

from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.reservation.wire import MODES
from kvpath.trace import TraceWriter, read_trace
from kvpath.workloads import Request, load_workload

ITM = IterationTimeModel.preset()
# links slow enough (20 Gbit/s) that pushes overlap and ECMP collides at this load, not so slow that all queue
SPEC = FabricSpec(leaves=4, spines=4, hosts_per_leaf=4, host_link_gbps=20.0, spine_link_gbps=20.0)


@pytest.fixture(scope="module")
def reqs():
    return list(load_workload("zipf", n=300, qps=30.0, seed=1, min_prompt=1024, max_prompt=4096, pd_ratio=20).requests)


@pytest.fixture(scope="module")
def runs(reqs):
    out = {}
    for mode in MODES:
        tr, info = simulate(SPEC, reqs, ServingConfig(mode=mode), ITM)
        out[mode] = tr
    return out


def test_decode_never_starts_before_the_kv_arrived_and_times_are_ordered(runs, tmp_path):
    for mode, tr in runs.items():
        with TraceWriter(tmp_path / f"{mode}.jsonl", tr.header) as w:  # the schema's own checks
            for rec in [*tr.requests, *tr.flows]:
                w.write(rec)
        back = read_trace(tmp_path / f"{mode}.jsonl")
        for q in back.requests:
            assert q.arrival_s <= q.prefill_start_s < q.prefill_end_s == q.push_start_s < q.push_end_s
            assert q.push_end_s <= q.decode_start_s < q.first_token_s <= q.completion_s


def test_cc_cuts_ecmp_tail_and_prefill_and_decode_compute_do_not_depend_on_the_mode(runs):
    fct = {m: np.array([f.fct_s for f in tr.flows]) for m, tr in runs.items()}
    assert np.percentile(fct["cc"], 99) < np.percentile(fct["ecmp"], 99)
    pre = {m: [q.prefill_end_s for q in tr.requests] for m, tr in runs.items()}
    assert pre["ecmp"] == pre["cc"] == pre["dc"]  # the network does not change P's drain
    # cc never puts two concurrent pushes of one leaf on one spine when another is free:
    # its slowdowns stay near 1 while ecmp's do not
    sd = {m: np.mean([f.fct_s / f.standalone_fct_s for f in tr.flows]) for m, tr in runs.items()}
    assert sd["cc"] < 1.1 < sd["ecmp"]


def test_dc_with_zero_delay_is_cc(runs):
    assert [q.lane for q in runs["dc"].requests] == [q.lane for q in runs["cc"].requests]
    assert [f.end_s for f in runs["dc"].flows] == [f.end_s for f in runs["cc"].flows]


def test_a_lone_request_takes_prefill_plus_wire_plus_one_decode_step():
    r = [Request("r0", 0.0, 2048, 3)]
    tr, _ = simulate(SPEC, r, ServingConfig(pools=(1, 1)), ITM)
    q, f = tr.requests[0], tr.flows[0]
    assert q.prefill_end_s == pytest.approx(ITM.prefill_time([2048]))
    assert f.fct_s == pytest.approx(f.bytes / (20e9 / 8))
    assert q.first_token_s == pytest.approx(q.push_end_s + ITM.decode_time([2048]))
    assert q.tpot_s == pytest.approx((ITM.decode_time([2049]) + ITM.decode_time([2050])) / 2)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="mode"):
        simulate(SPEC, [Request("r0", 0.0, 10, 2)], ServingConfig(mode="magic"), ITM)
    with pytest.raises(ValueError, match="do not fit"):
        simulate(SPEC, [Request("r0", 0.0, 10, 2)], ServingConfig(pools=(9, 8)), ITM)


def test_summary_has_the_published_table_shape(runs):
    s = summarize(runs["cc"], 0.1)
    assert {"fct_mean_s", "fct_p99_s", "ttft_mean_s", "tpot_mean_s", "wall_s"} <= set(s)
