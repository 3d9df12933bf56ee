"""The network backends are types in one registry (``kvpath.bridge.backends``): every verb
and library entry point dispatches through it, so a backend registered here, in the test,
is a backend everywhere (compare, calibrate, the serving simulation, the CLI's choices)
without a line changed in any of them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvpath.bridge import backends as registry
from kvpath.bridge.backends import NetworkBackend, Replay, backend_type, make, names, register
from kvpath.bridge.backends import base
from kvpath.bridge.calibrate import calibrate
from kvpath.bridge.compare import compare_replays, simulate_run, trace_flows
from kvpath.bridge.flow_model import FlowSpec, NetParams, trivial_fct
from kvpath.bridge.ns3_backend import Ns3Error, Ns3Params, ns3_root
from kvpath.bridge.serving_sim import ServingConfig, simulate
from kvpath.cli import main
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import read_trace
from kvpath.trace.header import TraceSetup
from kvpath.workloads import load_workload

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "envelope" / "quiet" / "ecmp" / "trace.jsonl"  # a testbed trace, 20 flows
SPEC = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2, host_link_gbps=10.0, spine_link_gbps=10.0)
ITM = IterationTimeModel.preset()


@dataclass(frozen=True)
class SlowOptions:
    factor: float = 2.0


class Slow(NetworkBackend):
    """A fourth backend, as a new module would define it: every flow ``factor`` times its
    time alone; it "drops" one packet per flow and holds 1500-byte packets."""

    name = "slow"
    counts_drops = True
    fits_efficiency = False
    options_type = SlowOptions

    def replay(self, flows: list[FlowSpec]) -> Replay:
        factor = (self.options or SlowOptions()).factor
        return Replay(trivial_fct(self.spec, flows, self.net) * factor, len(flows), {"host_up": len(flows)},
                      {"slow_flows": len(flows)})

    def packet_bytes(self) -> int:
        return 1500


class SlowOnFlow(Slow):
    """The same, its serving lanes decided on the flow model's clock (as ns3's are)."""

    name = "slowflow"
    lanes_by = "flow"


@pytest.fixture
def fourth(monkeypatch):
    """``slow`` and ``slowflow`` registered for one test only."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register(Slow)
    register(SlowOnFlow)
    return Slow


def _has_ns3() -> bool:
    try:
        ns3_root()
        return True
    except Ns3Error:  # pragma: no cover
        return False


def test_the_built_in_backends_in_their_order_and_what_each_can_do():
    assert names() == ("flow", "trivial", "ns3")  # the order "--backend: choose from ..." gives
    caps = {n: (backend_type(n).closed_loop, backend_type(n).lanes_by, backend_type(n).counts_drops,
                backend_type(n).fits_efficiency, backend_type(n).options_type) for n in names()}
    assert caps == {"flow": (True, None, False, True, None), "trivial": (False, None, False, True, None),
                    "ns3": (False, "flow", True, False, Ns3Params)}


@pytest.mark.parametrize("name", names())
def test_every_registered_backend_answers_the_protocol(name):
    cls = backend_type(name)
    assert issubclass(cls, NetworkBackend) and cls.name == name
    assert cls.closed_loop or cls.lanes_by is None or backend_type(cls.lanes_by).closed_loop
    if name == "ns3" and not _has_ns3():  # pragma: no cover
        pytest.skip("ns3 wheel not installed")
    h = SPEC.hosts()
    flows = [FlowSpec(h[0], h[2], 1_000_000, 0.0, 0), FlowSpec(h[1], h[3], 1_000_000, 0.0, 1)]
    b = make(name, SPEC, NetParams(), Ns3Params(mtu=65535))
    assert isinstance(b, cls) and b.packet_bytes() >= 0 and (b.packet_bytes() > 0) == (name == "ns3")
    res = b.replay(flows)
    assert res.fct_s.shape == (2,) and np.all(np.isfinite(res.fct_s)) and np.all(res.fct_s > 0)
    assert (res.drops is not None) == cls.counts_drops


def test_an_unknown_backend_is_refused_with_the_same_words_everywhere():
    with pytest.raises(SystemExit) as e:
        main(["bridge", "compare", str(TRACE), "--backend", "flow,ns4"])
    assert str(e.value) == "kvpath bridge compare: error: --backend: choose from flow, trivial, ns3, got 'flow,ns4'"
    with pytest.raises(SystemExit) as e:
        main(["bridge", "report", str(TRACE), "--out", "unused", "--backend", "flow,trivial"])  # one, no list
    assert str(e.value) == "kvpath bridge report: error: --backend: choose from flow, trivial, ns3, got 'flow,trivial'"
    want = "backend must be one of flow, trivial, ns3, got 'ns4'"
    for call in (lambda: make("ns4", SPEC, NetParams()), lambda: ServingConfig(pools=(1, 1), backend="ns4").validate(SPEC),
                 lambda: simulate_run("ns4", SPEC, [], NetParams())):
        with pytest.raises(ValueError) as v:
            call()
        assert str(v.value) == want


def test_registering_checks_the_name_and_the_lanes_clock(fourth):
    with pytest.raises(ValueError, match="registered already"):
        register(Slow)

    class Orphan(Slow):
        name, lanes_by = "orphan", "trivial"  # trivial is not closed loop: no clock to decide lanes on

    with pytest.raises(ValueError, match="no closed-loop backend"):
        register(Orphan)


def test_options_reach_only_the_backend_whose_type_they_are(fourth):
    assert make("slow", SPEC, NetParams(), SlowOptions(3.0)).options == SlowOptions(3.0)
    assert make("slow", SPEC, NetParams(), Ns3Params()).options is None  # compare passes the ns3 ones to all
    assert make("ns3", SPEC, NetParams(), SlowOptions()).options is None


def test_a_fourth_backend_is_a_choice_of_every_verb_and_compare_replays_through_it(fourth, capsys):
    with pytest.raises(SystemExit):
        main(["bridge", "compare", "--help"])
    assert "flow, trivial, ns3, slow, slowflow" in re.sub(r"\s+", " ", capsys.readouterr().out)
    with pytest.raises(SystemExit) as e:
        main(["bridge", "calibrate", str(TRACE), "--backend", "fast"])
    assert str(e.value).endswith("choose from flow, trivial, ns3, slow, slowflow, got 'fast'")

    assert main(["bridge", "compare", str(TRACE), "--backend", "trivial,slow", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["trivial", "slow"]
    assert out["slow"]["drops"] == {"measured": 0, "simulated": 20}  # its own count, as ns3's would be
    # twice trivial's FCTs: each relative error is 2 (1 + trivial's) - 1
    assert out["slow"]["fct"]["mean"] == pytest.approx(2 * (1 + out["trivial"]["fct"]["mean"]) - 1, rel=1e-12)

    trace = read_trace(TRACE)
    flows, _ = trace_flows(trace)
    r = compare_replays(trace, ["slow"], NetParams(), Ns3Params())["slow"]
    assert np.array_equal(r.fct[1], 2 * trivial_fct(TraceSetup(trace).fabric, flows, NetParams()))
    assert r.drops == 20 and r.tier_drops == {"host_up": 20}


def test_calibration_fits_a_fourth_backend_by_what_it_can_do(fourth):
    trace = read_trace(TRACE)  # its header gives the links' burst (128 KiB)
    fitted = calibrate(trace, "slow")
    # no efficiency to fit and a known burst: one network run (flow's grid takes 11)
    assert fitted.runs == 1 and fitted.net.efficiency == 1.0
    assert calibrate(trace, "flow").runs == 11
    with pytest.raises(ValueError, match="burst_bytes 1000 must exceed the slow MTU 1500"):
        calibrate(trace, "slow", burst_bytes=1000)


def test_the_serving_simulation_runs_a_fourth_backend_on_the_lanes_its_type_asks_for(fourth):
    reqs = list(load_workload("zipf", n=40, qps=40.0, seed=3, min_prompt=1024, max_prompt=4096, pd_ratio=20).requests)
    spec = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2, host_link_gbps=20.0, spine_link_gbps=20.0)
    runs = {}
    for b in ("trivial", "flow", "slow", "slowflow"):
        runs[b] = simulate(spec, reqs, ServingConfig(pools=(2, 2), mode="cc", backend=b, scale_s=4.0), ITM)
    for slow, like in (("slow", "trivial"), ("slowflow", "flow")):
        trace, info = runs[slow]
        assert trace.header.meta["backend"] == slow and info["slow_flows"] == 40
        assert [f.lane for f in trace.flows] == [f.lane for f in runs[like][0].flows]  # lanes decided as ``like``'s
    fct = {b: np.array([f.end_s - f.start_s for f in runs[b][0].flows]) for b in runs}
    assert np.allclose(fct["slow"], 2 * fct["trivial"], rtol=1e-12)  # same lanes, each alone, twice as long
    assert not np.array_equal([f.lane for f in runs["flow"][0].flows], [f.lane for f in runs["trivial"][0].flows])


def test_no_module_outside_the_registry_dispatches_on_a_backend_name():
    """A backend's name is compared in ``backends/`` only: elsewhere a branch on one would
    leave a fourth backend out of it."""
    names_re = "|".join(map(re.escape, names()))
    branch = re.compile(rf"""(==|!=)\s*["']({names_re})["']|["']({names_re})["']\s*(==|!=)|"""
                        rf"""\bin\s*[(\[{{]\s*["']({names_re})["']""")
    offenders = [f"{p.name}:{i}" for p in sorted((ROOT / "simulator_bridge").glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert offenders == []
    assert registry.names is names  # the package re-exports the one registry
