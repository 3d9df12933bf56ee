"""The one reader of a trace's header (kvpath/trace/header.py), the one summary of its
metrics (kvpath/trace/metrics.py) and the shared CDF (kvpath/plotting.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpath.bridge.compare import header_net_params
from kvpath.bridge.flow_model import NetParams
from kvpath.bridge.serving_sim import ServingConfig, simulate, summarize
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import FiveTuple, FlowRecord, Header, RequestRecord, Trace
from kvpath.trace.header import TraceSetup
from kvpath.trace.metrics import TraceMetrics
from kvpath.workloads import load_workload

SPEC = FabricSpec.resolve("small")


@pytest.fixture(scope="module")
def simulated() -> Trace:
    reqs = list(load_workload("zipf", n=20, qps=20.0, seed=1).requests)
    itm = IterationTimeModel.preset("qwen2.5-7b", "h100")
    net = NetParams(overhead_s=0.001, efficiency=0.9, burst_bytes=4096)
    return simulate(SPEC, reqs, ServingConfig(pools=(2, 1), mode="cc", reserve_at="push", net=net), itm)[0]


def test_the_simulation_writes_what_the_reader_reads_back(simulated: Trace) -> None:
    s = TraceSetup(simulated)
    assert s.fabric == SPEC and not s.is_testbed and s.time_scale == 1.0
    assert s.pools == (2, 1) and s.reserve_at == "push"
    assert s.iteration_time.model.name == "qwen2.5-7b"
    assert s.iteration_time_or_preset()[1] == "iteration-time model from the trace header (qwen2.5-7b on h100)"
    assert header_net_params(s) == NetParams(overhead_s=0.001, efficiency=0.9, burst_bytes=4096)
    assert s.burst_bytes is None and s.queue_bytes is None  # the testbed's links' values


def test_a_testbed_header() -> None:
    h = Header(t0_unix=1.7e9, mode="ecmp", fabric=SPEC.to_dict(), scale_b=1000.0, scale_s=250.0, link_mbit=100.0,
               meta={"pools": "1P1D", "burst_bytes": 131072, "queue_bytes": 1 << 20, "time_scale": 7.0})
    s = TraceSetup(Trace(h, [], []))
    assert s.is_testbed and s.time_scale == 4.0  # B/S: a testbed trace's meta.time_scale is not read
    assert s.fabric == dataclasses.replace(SPEC, host_link_gbps=0.1, spine_link_gbps=0.1)
    assert (s.pools, s.burst_bytes, s.queue_bytes, s.net, s.reserve_at) == ((1, 1), 131072, 1 << 20, None, None)
    assert header_net_params(s) == NetParams(burst_bytes=131072)
    assert s.iteration_time.model.name == "llama-3-8b"  # none in the header: the default preset


def test_fallbacks_and_malformed_fields_name_the_field() -> None:
    q = [RequestRecord(request_id=f"r{i}", arrival_s=0.0, prompt_tokens=1, output_tokens=1, p_instance=p,
                       d_instance=d) for i, (p, d) in enumerate([("a", "x"), ("b", "x"), ("a", "y")])]
    h = Header(t0_unix=0.0, fabric=SPEC.to_dict(),
               meta={"pools": "8x8", "time_scale": 1.5, "burst_bytes": -1, "iteration_time": {"model": "nope"},
                     "reserve_at": "later"})
    s = TraceSetup(Trace(h, q, []))
    assert s.pools == (2, 2)  # unparsable meta.pools: the distinct instances of the requests
    assert s.time_scale == 1.5 and s.reserve_at is None
    with pytest.raises(ValueError, match="meta.burst_bytes"):
        s.burst_bytes
    with pytest.raises(ValueError, match="meta.iteration_time: .*nope"):
        s.iteration_time
    itm, note = s.iteration_time_or_preset()  # a figure still gets drawn, and says why on the preset
    assert itm.model.name == "llama-3-8b" and "unusable" in note and "preset is used" in note
    assert TraceSetup(Trace(Header(t0_unix=0.0), [], [])).pools is None
    with pytest.raises(ValueError, match="meta.time_scale"):
        TraceSetup(Trace(Header(t0_unix=0.0, meta={"time_scale": 0}), [], [])).time_scale


def test_metrics_are_the_formulas_and_none_where_nothing_is_measured(simulated: Trace) -> None:
    m = TraceMetrics.of(simulated)
    fct = np.array([f.fct_s for f in simulated.flows])
    ttft = np.array([q.ttft_s for q in simulated.requests])
    assert (m.requests, m.flows) == (20, 20)
    assert m.fct_mean_s == float(fct.mean()) and m.fct_p99_s == float(np.percentile(fct, 99))
    assert m.ttft_mean_s == float(ttft.mean()) and m.ttft_p99_s == float(np.percentile(ttft, 99))
    assert m.slowdown_mean == float(np.mean([f.fct_s / f.standalone_fct_s for f in simulated.flows]))
    assert m.slowdown_mean >= 1.0
    row = summarize(simulated, 0.5)
    assert list(row) == ["mode", "backend", "requests", "fct_mean_s", "fct_p99_s", "slowdown_mean", "ttft_mean_s",
                         "ttft_p99_s", "tpot_mean_s", "wall_s"]
    assert row["fct_p99_s"] == m.fct_p99_s and row["mode"] == "cc" and row["wall_s"] == 0.5
    failed = RequestRecord(request_id="f", arrival_s=0.0, prompt_tokens=8, output_tokens=0, status="http 503")
    flow = FlowRecord(flow_id="x", request_id=None, five_tuple=FiveTuple("10.0.0.1", "10.1.0.1", 1, 2), bytes=1,
                      start_s=0.0, end_s=0.5)
    e = TraceMetrics.of(Trace(Header(t0_unix=0.0), [failed], [flow]))
    assert (e.requests, e.fct_mean_s, e.slowdown_mean, e.ttft_mean_s, e.tpot_mean_s) == (1, 0.5, None, None, None)


def test_the_shared_cdf_steps_to_one() -> None:
    from kvpath.plotting import cdf, pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    cdf(ax, [3.0, 1.0, 2.0], "x")
    cdf(ax, [], "empty")  # draws nothing
    (line,) = ax.lines
    assert list(line.get_xdata()) == [1.0, 2.0, 3.0] and list(line.get_ydata()) == pytest.approx([1 / 3, 2 / 3, 1])
    assert line.get_label() == "x (n=3)"
    plt.close(fig)


def test_header_fabric_runs_each_tier_at_the_testbed_rate_it_had():
    from kvpath.trace.header import header_fabric

    os2 = FabricSpec(leaves=4, spines=4, hosts_per_leaf=4, spine_link_gbps=50.0)  # rack4-os2
    h = Header(t0_unix=0.0, fabric=os2.to_dict(), link_mbit=100.0, host_link_mbit=200.0)
    assert (header_fabric(h).host_link_gbps, header_fabric(h).spine_link_gbps) == (0.2, 0.1)
    # a trace without host_link_mbit: the testbed scaled every tier by one factor
    old = Header(t0_unix=0.0, fabric=os2.to_dict(), link_mbit=100.0)
    assert (header_fabric(old).host_link_gbps, header_fabric(old).spine_link_gbps) == (0.2, 0.1)
    # no testbed rates: the spec's own
    sim = Header(t0_unix=0.0, fabric=os2.to_dict())
    assert (header_fabric(sim).host_link_gbps, header_fabric(sim).spine_link_gbps) == (100.0, 50.0)
    assert FabricSpec.resolve("rack4-os2") == os2


def test_the_testbeds_drops_and_retransmissions_are_read_from_the_header():
    t = Trace(Header(t0_unix=0.0, link_mbit=100.0, meta={"drops": 45, "tcp_retrans_segs": 51}), [], [])
    assert (TraceSetup(t).drops, TraceSetup(t).retransmits) == (45, 51)
    t = Trace(Header(t0_unix=0.0), [], [])
    assert (TraceSetup(t).drops, TraceSetup(t).retransmits) == (None, None)
    with pytest.raises(ValueError, match="meta.drops"):
        TraceSetup(Trace(Header(t0_unix=0.0, meta={"drops": -1}), [], [])).drops
