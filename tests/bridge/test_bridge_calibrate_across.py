"""Calibration across traces: fitted on whole traces of one fabric, evaluated on other
traces of it. Simulated traces whose constants are known (the serving simulation with a
given per-flow overhead and link efficiency): fitted on one workload, the constants are
recovered and a different workload's error falls to zero; the evaluated trace never
steers the fit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import msgspec
import pytest

from kvpath.bridge.calibrate_across import calibrate_across
from kvpath.bridge.flow_model import NetParams
from kvpath.bridge.serving_sim import ServingConfig, simulate
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import TraceWriter
from kvpath.workloads import load_workload

SPEC = dataclasses.replace(FabricSpec.resolve("rack4"), host_link_gbps=2.0, spine_link_gbps=2.0)
TRUE_NET = NetParams(overhead_s=0.004, efficiency=0.9)


def _trace(qps: float, seed: int, spec: FabricSpec = SPEC, workload: str = "zipf"):
    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    w = load_workload(workload, n=80, qps=qps, seed=seed, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    return simulate(spec, list(w.requests), ServingConfig(mode="ecmp", scale_s=100, net=TRUE_NET), itm)[0]


@pytest.fixture(scope="module")
def traces():
    return {"light": _trace(10, 1), "heavy": _trace(40, 2), "other": _trace(25, 3)}


def test_fitted_on_one_workload_the_constants_carry_to_another(traces):
    # the links' burst known, as a testbed trace's header gives it: lone flows cannot tell
    # a burst from a per-flow overhead (both shift every FCT by a constant)
    c = calibrate_across([("light", traces["light"])], [("heavy", traces["heavy"]), ("other", traces["other"])],
                         "flow", burst_bytes=0)
    assert c.net.efficiency == pytest.approx(TRUE_NET.efficiency)
    assert c.net.overhead_s == pytest.approx(TRUE_NET.overhead_s, abs=1e-9)
    assert [e.name for e in c.evaluated] == ["heavy", "other"]
    for e in c.evaluated:
        assert abs(e.fct.after.mean) < 1e-6 and abs(e.fct.after.p99) < 1e-6
        assert abs(e.fct.before.mean) > 0.01  # the defaults were off: the fit did something


def test_the_evaluated_trace_never_steers_the_fit(traces):
    """Scaling the evaluated trace's measured FCTs changes its errors, never the constants."""
    heavy = traces["heavy"]
    slowed = msgspec.structs.replace(heavy, flows=[msgspec.structs.replace(f, end_s=f.start_s + 2 * f.fct_s)
                                                   for f in heavy.flows])
    a = calibrate_across([("light", traces["light"])], [("heavy", heavy)], "flow")
    b = calibrate_across([("light", traces["light"])], [("slowed", slowed)], "flow")
    assert (a.net, a.compute) == (b.net, b.compute)
    assert a.evaluated[0].fct.after.mean != pytest.approx(b.evaluated[0].fct.after.mean)


def test_leave_one_out_with_a_shared_cache_runs_each_fit_once_and_fits_the_same(traces):
    names = list(traces)
    cache: dict = {}
    for k, ev in enumerate(names):
        fit = [(n, traces[n]) for n in names if n != ev]
        plain = calibrate_across(fit, [(ev, traces[ev])], "flow")
        cached = calibrate_across(fit, [(ev, traces[ev])], "flow", cache=cache)
        assert (cached.net, cached.compute) == (plain.net, plain.compute)
        assert cached.evaluated[0].to_dict() == plain.evaluated[0].to_dict()
        # the first fold runs all; later ones only what no earlier fold's fit ran
        assert cached.runs == plain.runs if k == 0 else cached.runs < plain.runs
    # every (fit trace, constants) ran once over the three folds: each trace is in two folds' fits
    grid_runs = len(cache) // len(names)
    assert grid_runs > 1 and len(cache) == grid_runs * len(names)


def test_a_fit_trace_given_again_to_evaluate_and_another_fabric_are_refused(traces):
    with pytest.raises(ValueError, match="also a fit trace"):
        calibrate_across([("a", traces["light"])], [("b", traces["heavy"]), ("c", traces["light"])], "flow")
    other = _trace(10, 1, spec=dataclasses.replace(SPEC, spine_link_gbps=1.0))
    with pytest.raises(ValueError, match="x: its fabric"):
        calibrate_across([("a", traces["light"])], [("x", other)], "flow")
    with pytest.raises(ValueError, match="at least one trace to fit on and one to evaluate"):
        calibrate_across([("a", traces["light"])], [], "flow")


def test_the_cli_fits_on_the_positional_traces_and_evaluates_the_others(tmp_path, traces):
    paths = {}
    for name, t in traces.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        with TraceWriter(paths[name], t.header) as w:
            for r in t.requests + t.flows:
                w.write(r)
    cmd = [sys.executable, "-m", "kvpath.cli", "bridge", "calibrate", str(paths["light"]), "--evaluate",
           f"{paths['heavy']},{paths['other']}", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (out,) = json.loads(r.stdout)
    assert out["fit_traces"] == [str(paths["light"])]
    assert [e["trace"] for e in out["evaluated"]] == [str(paths["heavy"]), str(paths["other"])]
    assert out["net"]["efficiency"] == pytest.approx(0.9)
    bad = subprocess.run(cmd[:7] + [f"{paths['heavy']},{paths['light']}"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "also a fit trace" in bad.stderr and "Traceback" not in bad.stderr


def test_traces_whose_links_had_another_burst_or_buffer_are_refused_unless_the_burst_is_given(traces):
    import msgspec as ms

    def with_meta(t, **meta):
        return ms.structs.replace(t, header=ms.structs.replace(t.header, meta={**t.header.meta, **meta}))

    a = with_meta(traces["light"], burst_bytes=65536, queue_bytes=1 << 20)
    b = with_meta(traces["heavy"], burst_bytes=131072, queue_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"b: its links' burst \(131072\) is not a's \(65536\)"):
        calibrate_across([("a", a)], [("b", b)], "flow")
    c = calibrate_across([("a", a)], [("b", b)], "flow", burst_bytes=0)  # given: one bucket for all
    assert c.net.burst_bytes == 0
    deep = with_meta(traces["heavy"], burst_bytes=65536, queue_bytes=4 << 20)
    with pytest.raises(ValueError, match="b: its links' buffer"):
        calibrate_across([("a", a)], [("b", deep)], "flow")
    bad = with_meta(traces["heavy"], burst_bytes=-1)
    with pytest.raises(ValueError, match="^bad: header meta.burst_bytes"):
        calibrate_across([("a", a)], [("bad", bad)], "flow")


def _with_cold_cost(trace, cold_s: float):
    """The trace with ``cold_s`` more on each lane's first flow, as a testbed run has."""
    from kvpath.bridge.compare import first_on_connection

    cold = first_on_connection(trace)
    return msgspec.structs.replace(trace, flows=[
        msgspec.structs.replace(f, end_s=f.end_s + cold_s) if c else f for f, c in zip(trace.flows, cold)])


def test_a_lanes_first_push_cost_is_fitted_apart_from_the_overhead_and_carries_to_another_workload(traces):
    from kvpath.bridge.compare import first_on_connection

    light, heavy = _with_cold_cost(traces["light"], 0.003), _with_cold_cost(traces["heavy"], 0.003)
    cold = first_on_connection(light)
    assert 0 < sum(cold) < len(cold)  # both kinds are there to tell apart
    c = calibrate_across([("light", light)], [("heavy", heavy)], "flow", burst_bytes=0)
    assert c.net.cold_s == pytest.approx(0.003, abs=1e-9)
    assert c.net.overhead_s == pytest.approx(TRUE_NET.overhead_s, abs=1e-9)
    (e,) = c.evaluated
    assert abs(e.fct.after.mean) < 1e-6 and abs(e.fct.after.p99) < 1e-6
    # without the cost on the fitted trace, none is found, and the evaluated one is off
    plain = calibrate_across([("light", traces["light"])], [("heavy", heavy)], "flow", burst_bytes=0)
    assert plain.net.cold_s == pytest.approx(0.0, abs=1e-12) and plain.evaluated[0].fct.after.mean < -1e-4
