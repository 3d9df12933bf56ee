"""``calibrate`` and the request replay on simulated traces whose constants are known:
a trace made by the serving simulation with a given per-flow overhead and link
efficiency must be recovered exactly, and the held-out error must fall to zero."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import TraceWriter
from kvpath.workloads import load_workload
from kvpath.bridge.calibrate import calibrate
from kvpath.bridge.compare import compare
from kvpath.bridge.flow_model import NetParams
from kvpath.bridge.request_replay import ComputeParams, ReplayInput, replay
from kvpath.bridge.serving_sim import ServingConfig, simulate

SPEC = dataclasses.replace(FabricSpec.resolve("rack4"), host_link_gbps=2.0, spine_link_gbps=2.0)
TRUE_NET = NetParams(overhead_s=0.004, efficiency=0.9)


@pytest.fixture(scope="module")
def trace():
    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    w = load_workload("zipf", n=120, qps=30, seed=2, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    tr, _ = simulate(SPEC, list(w.requests), ServingConfig(mode="ecmp", scale_s=100, net=TRUE_NET), itm)
    return tr


def test_the_replay_reproduces_a_simulated_trace_exactly(trace):
    inp = ReplayInput.of(trace)
    fct = np.array([f.fct_s for f in trace.flows])
    ttft, tpot = replay(inp, fct, ComputeParams())
    assert np.allclose(ttft, inp.ttft, rtol=0, atol=1e-9)
    ok = np.isfinite(inp.tpot)
    assert np.allclose(tpot[ok], inp.tpot[ok], rtol=0, atol=1e-9)
    # a slower network shows up in TTFT and never makes a request earlier
    ttft2, _ = replay(inp, fct + 0.01, ComputeParams())
    assert (ttft2 >= ttft + 0.01 - 1e-9).all()


def with_front_ends(trace, fe: np.ndarray):
    """The trace as a testbed would record it had each request spent ``fe`` seconds
    between the client and P's server: the client sent it ``fe`` earlier (everything
    moved 0.1 s later so that no arrival goes below 0)."""
    reqs = [msgspec.structs.replace(q, arrival_s=q.arrival_s + 0.1 - f, p_arrival_s=q.arrival_s + 0.1,
                                    first_token_s=q.first_token_s + 0.1, ttft_s=q.ttft_s + f)
            for q, f in zip(trace.requests, fe)]
    return msgspec.structs.replace(trace, requests=reqs)


def test_a_request_reaches_p_when_its_trace_says_it_did(trace):
    from kvpath.bridge.calibrate import FitSet, fit_compute

    fe = np.where(np.arange(len(trace.requests)) % 3 == 2, 0.030, 0.002)  # 2, 2, 30 ms: median 2, mean 11
    shifted = with_front_ends(trace, fe)
    inp = ReplayInput.of(shifted)
    assert np.allclose(inp.front_end, fe, rtol=0, atol=1e-9)
    fct = np.array([f.fct_s for f in trace.flows])
    ttft, _ = replay(inp, fct, ComputeParams())
    assert np.allclose(ttft, inp.ttft, rtol=0, atol=1e-9)  # the measured front end, exactly
    # without it every request is at P as the client sends it: earlier (the queue order may change)
    ttft_now, _ = replay(inp, fct, ComputeParams(), measured_front_end=False)
    assert ttft_now.mean() < ttft.mean() - 0.005
    # a constant front end for requests the trace says nothing of: the fit's median
    c = fit_compute([FitSet.whole(shifted)], [fct])
    assert c.front_end_s == pytest.approx(0.002)
    assert abs(c.request_overhead_s) < 1e-9
    # a request its trace says nothing of gets the constant; the others keep theirs
    mixed = msgspec.structs.replace(shifted, requests=[msgspec.structs.replace(q, p_arrival_s=None) if k % 3 == 2 else q
                                                       for k, q in enumerate(shifted.requests)])
    inp_m = ReplayInput.of(mixed)
    ttft_m, _ = replay(inp_m, fct, dataclasses.replace(c, front_end_s=0.030))
    assert np.allclose(ttft_m, inp.ttft, rtol=0, atol=1e-9)  # 30 ms, as those requests had
    c = dataclasses.replace(c, front_end_s=0.012)
    ttft_0, _ = replay(ReplayInput.of(trace), fct, dataclasses.replace(c, front_end_s=0.0))
    same = ReplayInput.of(with_front_ends(trace, np.full(fe.size, 0.012)))
    for measured in (True, False):  # 12 ms each, measured or the constant: the same schedule, later
        assert np.allclose(replay(same, fct, c, measured)[0], ttft_0 + 0.012, rtol=0, atol=1e-9)


def test_the_engines_own_cost_per_iteration_is_not_scaled_by_the_trace_s_time_scale():
    """One request alone: a prefill iteration, then one decode iteration per token. The
    model's time is scaled by B/S; iteration_wall_s is added once per iteration on the
    trace's own clock, whatever B/S is."""
    from kvpath.trace import RequestRecord

    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    w = load_workload("zipf", n=1, qps=1, seed=0, min_prompt=1000, max_prompt=1000, pd_ratio=200)
    tr, _ = simulate(SPEC, list(w.requests), ServingConfig(mode="ecmp", scale_s=100, net=TRUE_NET), itm)
    (q,) = tr.requests
    q = msgspec.structs.replace(q, output_tokens=4)
    for scale in (1.0, 2.5):
        tr_s = msgspec.structs.replace(tr, requests=[q])
        inp = ReplayInput.of(tr_s)
        inp.time_scale = scale
        fct = np.array([f.fct_s for f in tr.flows])
        ttft0, tpot0 = replay(inp, fct, ComputeParams())
        ttft1, tpot1 = replay(inp, fct, ComputeParams(iteration_wall_s=0.003))
        assert ttft1[0] - ttft0[0] == pytest.approx(2 * 0.003, abs=1e-12)  # one prefill, one decode iteration
        assert tpot1[0] - tpot0[0] == pytest.approx(0.003, abs=1e-12)  # one iteration per later token
        # the model's own overhead is scaled: 1 ms more per iteration is 2 x 1 ms x B/S more TTFT
        ttft2, _ = replay(inp, fct, ComputeParams(iteration_overhead_s=itm.overhead_s + 0.001))
        assert ttft2[0] - ttft0[0] == pytest.approx(2 * 0.001 * scale, abs=1e-12)
    assert isinstance(q, RequestRecord)


def test_at_tp2_a_request_waits_for_its_last_flow(trace):
    """Each request's flow split in two, as a P TP=2 -> D TP=2 trace has it (one flow per
    rank pair, listed in any order): the replay's KV time is the slower flow's."""
    import msgspec

    r0 = [msgspec.structs.replace(f, bytes=f.bytes // 2) for f in trace.flows]
    r1 = [msgspec.structs.replace(f, bytes=f.bytes - f.bytes // 2, flow_id=f"{f.flow_id}-r1") for f in trace.flows]
    tp2 = msgspec.structs.replace(trace, flows=r1 + r0)  # rank 1's flows first: grouping must not rely on order
    inp, inp2 = ReplayInput.of(trace), ReplayInput.of(tp2)
    assert inp2.flows.size == 2 * inp.flows.size
    base = np.array([f.fct_s for f in trace.flows])
    ttft_tp1, _ = replay(inp, base, ComputeParams())
    assert np.allclose(replay(inp2, np.concatenate([base, base]), ComputeParams())[0], ttft_tp1, rtol=0, atol=1e-9)
    for fct in (np.concatenate([base + 0.02, base]), np.concatenate([base, base + 0.02])):  # rank 1, then rank 0 late
        ttft, _ = replay(inp2, fct, ComputeParams())
        assert (ttft >= ttft_tp1 + 0.02 - 1e-9).all()  # the slower flow sets every request's KV time
    # calibration's split takes both flows of a training request
    mask = np.zeros(len(inp2.reqs), dtype=bool)
    mask[:3] = True
    got = sorted(tp2.flows[i].request_id for i in inp2.flows_of(mask))
    assert got == sorted(r.request_id for r in inp2.reqs[:3] for _ in range(2))


def test_calibrate_recovers_the_known_network_constants(trace):
    c = calibrate(trace, "flow", train_frac=0.5)
    assert c.net.efficiency == pytest.approx(TRUE_NET.efficiency)
    assert c.net.overhead_s == pytest.approx(TRUE_NET.overhead_s, abs=1e-9)
    assert c.net.burst_bytes == 0
    assert abs(c.fct.before.mean) > 0.05  # uncalibrated, the model is off ...
    for e in (c.fct.after, c.ttft.after, c.tpot.after):  # ... and calibrated, exact on held-out requests
        assert max(abs(e.mean), abs(e.p99), abs(e.bias)) < 1e-6
    assert c.train_requests == 60 and c.held_requests == 60


def test_compare_gives_fct_ttft_and_tpot_per_backend(trace):
    out = compare(trace, ["flow", "trivial"], TRUE_NET)
    assert abs(out["flow"]["fct"].mean) < 1e-9 and abs(out["flow"]["ttft"].mean) < 1e-9
    assert out["trivial"]["fct"].p99 < 0  # alone, every flow is faster: trivial is optimistic


def test_calibrate_cli_json_and_errors(tmp_path, trace):
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, trace.header) as w:
        for rec in [*trace.requests, *trace.flows]:
            w.write(rec)
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "calibrate", str(path), "--backend", "trivial",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (res,) = json.loads(r.stdout)
    assert res["backend"] == "trivial" and set(res) >= {"net", "compute", "fct", "ttft", "tpot"}
    assert set(res["fct"]) == {"before", "after"}
    for args, field in ((["--train-frac", "1.5"], "train_frac"), (["--backend", "ns4"], "--backend")):
        r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "calibrate", str(path), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and field in r.stderr and "Traceback" not in r.stderr


NS3_SPEC = dataclasses.replace(FabricSpec.resolve("rack4"), host_link_gbps=0.5, spine_link_gbps=0.5)
NS3_NET = NetParams(overhead_s=0.004, burst_bytes=64 << 10)  # the testbed's links have token buckets


@pytest.fixture(scope="module")
def ns3_trace():
    from kvpath.bridge.ns3_backend import Ns3Error, ns3_root

    try:
        ns3_root()
    except Ns3Error as e:  # pragma: no cover - the setup script installs it
        pytest.skip(f"ns3 wheel not installed: {e}")
    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    w = load_workload("zipf", n=40, qps=40, seed=3, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    tr, _ = simulate(NS3_SPEC, list(w.requests), ServingConfig(mode="ecmp", backend="ns3", scale_s=100, net=NS3_NET),
                     itm)
    assert "burst_bytes" not in tr.header.meta  # so calibrate has to find it
    return tr


def test_calibrate_recovers_an_ns3_token_bucket_and_offset(ns3_trace):
    c = calibrate(ns3_trace, "ns3", train_frac=0.5)
    assert c.net.burst_bytes == NS3_NET.burst_bytes
    assert c.net.overhead_s == pytest.approx(NS3_NET.overhead_s, abs=1e-9)
    assert c.runs == 5  # burst 0 and the four grid bursts above the MTU
    assert abs(c.fct.before.mean) > 0.02
    assert max(abs(c.fct.after.mean), abs(c.fct.after.p99)) < 1e-6
    # a known burst is not fitted: one network run
    k = calibrate(ns3_trace, "ns3", train_frac=0.5, burst_bytes=64 << 10)
    assert (k.runs, k.net.burst_bytes) == (1, 64 << 10)
    with pytest.raises(ValueError, match="exceed the ns3 MTU"):
        calibrate(ns3_trace, "ns3", burst_bytes=4096)


def test_the_per_push_offset_comes_from_pushes_that_shared_no_link():
    from kvpath.bridge.calibrate import FitSet, fixed_offsets, unshared
    from kvpath.bridge.flow_model import FlowSpec

    h = SPEC.hosts()  # rack4: 4 hosts a leaf
    lone = [FlowSpec(h[0], h[4], 10**6, t, 0) for t in (0.0, 1.0, 2.0)]  # one port, never at once
    shared = [FlowSpec(h[1], h[5], 10**6, 5.0, 1), FlowSpec(h[1], h[9], 10**6, 5.001, 2),  # a sender's port
              FlowSpec(h[2], h[7], 10**6, 5.0, 0), FlowSpec(h[3], h[7], 10**6, 5.002, 3),  # a receiver's
              FlowSpec(h[8], h[12], 10**6, 5.0, 2), FlowSpec(h[9], h[13], 10**6, 5.0, 2)]  # leaf 2's uplink to spine 2
    sim = np.full(9, 0.010)
    measured = sim + np.array([0.003] * 3 + [0.050] * 6)  # the model 50 ms short under contention
    fs = FitSet(SPEC, lone + shared, measured, None, np.ones(9, dtype=bool), np.ones(0, dtype=bool))
    assert unshared(fs).tolist() == [True] * 3 + [False] * 6
    assert fixed_offsets([fs], [sim]) == (pytest.approx(0.003), 0.0)  # not the median of all (50 ms)
    # too few pushes alone to tell: the median of all
    few = FitSet(SPEC, lone[:2] + shared, measured[1:], None, np.ones(8, dtype=bool), np.ones(0, dtype=bool))
    assert fixed_offsets([few], [sim[1:]]) == (pytest.approx(0.050), 0.0)
    # lanes' first pushes, 5 ms more, 3 alone and 3 sharing: both medians from the pushes alone
    first = [FlowSpec(h[0], h[4], 10**6, t, 0, cold=True) for t in (3.0, 4.0, 4.5)]
    first += [FlowSpec(h[1], h[13], 10**6, 5.0005, 3, cold=True), FlowSpec(h[2], h[6], 10**6, 5.0005, 1, cold=True),
              FlowSpec(h[3], h[6], 10**6, 5.0006, 1, cold=True)]
    both = FitSet(SPEC, lone + shared + first, np.concatenate([measured, np.full(3, 0.018), np.full(3, 0.065)]), None,
                  np.ones(15, dtype=bool), np.ones(0, dtype=bool))
    assert both.alone.tolist() == [True] * 3 + [False] * 6 + [True] * 3 + [False] * 3
    assert fixed_offsets([both], [np.full(15, 0.010)]) == (pytest.approx(0.003), pytest.approx(0.005))
    # 2 first pushes alone are not enough: both medians of all (not 3 ms from the lone and 55 from all)
    fewer = FitSet(SPEC, both.flows[:10] + both.flows[11:], np.delete(both.measured, 10), None,
                   np.ones(14, dtype=bool), np.ones(0, dtype=bool))
    over, cold = fixed_offsets([fewer], [np.full(14, 0.010)])
    assert over == pytest.approx(0.050) and cold == pytest.approx(0.005)


def test_the_offset_is_robust_to_a_warm_up():
    from kvpath.bridge.calibrate import offset_of

    # 3 ms everywhere, but the first tenth of the flows (fresh lanes) 30 ms more
    sim = np.linspace(0.01, 0.1, 200)
    meas = sim + 0.003
    meas[:20] += 0.030
    assert offset_of(meas, sim) == pytest.approx(0.003)  # a mean would say 6 ms
    assert offset_of(np.zeros(0), np.zeros(0)) == 0.0


def test_calibrate_cli_rejects_a_bad_burst(tmp_path, trace):
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, trace.header) as w:
        for rec in [*trace.requests, *trace.flows]:
            w.write(rec)
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "calibrate", str(path), "--burst-bytes", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--burst-bytes" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("bad", [dict(speed=0.0), dict(iteration_wall_s=-0.001), dict(iteration_wall_s=float("nan")),
                                 dict(iteration_overhead_s=-1.0), dict(request_overhead_s=float("inf"))])
def test_compute_constants_out_of_range_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ComputeParams(**bad)
    ComputeParams(request_overhead_s=-0.004)  # a fitted residual may be negative
