"""The serving simulation with the reservation service's placement (joint, network,
load): the same decision code as the service, each request's P, D and lane from it, the
drains and the network timing the choices."""

import dataclasses

import pytest

from kvpath.bridge.placement_sim import place_requests
from kvpath.bridge.serving_sim import ServingConfig, _Lanes, simulate, summarize
from kvpath.fabric import FabricSpec, pd_placement
from kvpath.iteration_time import IterationTimeModel
from kvpath.workloads import load_workload

SPEC = dataclasses.replace(FabricSpec.resolve("rack4"), host_link_gbps=25.0, spine_link_gbps=25.0)
ITM = IterationTimeModel.preset()


@pytest.fixture(scope="module")
def reqs():
    return list(load_workload("zipf", n=200, qps=20, seed=3).requests)


def test_each_request_is_served_where_the_service_placed_it(reqs):
    cfg = ServingConfig(pools=(4, 4), mode="cc", backend="flow", placement="joint")
    p_hosts, d_hosts = pd_placement(SPEC, 4, 4)
    p_of, d_of, lanes, log = place_requests(SPEC, reqs, cfg, ITM, p_hosts, d_hosts, _Lanes(SPEC, cfg.lanes))
    by_tid = {d["transfer_id"]: d for d in log}
    assert len(by_tid) == len(reqs)
    for i, r in enumerate(reqs):  # the decision log names the engines and lane each request got
        d = by_tid[r.request_id]
        assert (int(d["placement"]["p"]), int(d["placement"]["d"]), d["lane"]) == (p_of[i], d_of[i], lanes[i])
    trace, _ = simulate(SPEC, reqs, cfg, ITM)
    got = {rec.request_id: (rec.p_instance, rec.d_instance, rec.lane) for rec in trace.requests}
    assert got == {r.request_id: (p_hosts[p_of[i]], d_hosts[d_of[i]], lanes[i]) for i, r in enumerate(reqs)}
    assert all(rec.first_token_s >= rec.push_end_s >= rec.prefill_end_s for rec in trace.requests)


def test_placements_are_deterministic_and_labelled(reqs):
    rows = []
    for placement in ("", "load", "network", "joint"):
        cfg = ServingConfig(pools=(4, 4), mode="cc", backend="flow", placement=placement)
        a, _ = simulate(SPEC, reqs, cfg, ITM)
        b, _ = simulate(SPEC, reqs, cfg, ITM)
        assert [r.ttft_s for r in a.requests] == [r.ttft_s for r in b.requests]
        rows.append(summarize(a, 0.0)["mode"])
    assert rows == ["cc", "cc/load", "cc/network", "cc/joint"]


def test_load_spreads_by_requests_in_flight_and_joint_avoids_a_shared_downlink(reqs):
    """load: least outstanding mixes P and D, so pushes of several P meet at one D's
    downlink; joint prices that in and its pushes are never slower on the tail."""
    out = {}
    for placement in ("load", "joint"):
        cfg = ServingConfig(pools=(4, 4), mode="cc", backend="flow", placement=placement)
        trace, _ = simulate(SPEC, reqs, cfg, ITM)
        out[placement] = summarize(trace, 0.0)
    assert out["joint"]["fct_p99_s"] <= out["load"]["fct_p99_s"]


def test_a_bad_placement_is_refused_naming_it():
    with pytest.raises(ValueError, match="placement"):
        ServingConfig(placement="fastest").validate(SPEC)
