"""benchmarks/bridge_suite.py: its Azure-format trace reads back through the importer,
its goal counts are right, and one configuration runs end to end on a real fabric with
every trace evaluated on constants fitted on the others. No error bound is asserted:
those depend on this machine's load (the suite's tables are in docs/results.md, section 7)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvpath.testbed.netns_fabric import netns_problem
from kvpath.workloads import load_workload

ROOT = Path(__file__).resolve().parents[2]


def _load_suite():
    """The benchmark script as a module, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bridge_suite", ROOT / "benchmarks" / "bridge_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bridge_suite = _load_suite()


def test_its_azure_format_trace_is_read_by_the_importer_and_is_bursty(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    bridge_suite.write_azure(p, 200, seed=1)
    w = load_workload(str(p), n=200, qps=10)
    assert len(w) == 200
    gaps = np.diff([r.arrival_s for r in w])
    assert gaps.std() / gaps.mean() > 1.2  # burstier than Poisson (CV 1)
    assert 256 <= min(r.prompt_tokens for r in w) and max(r.prompt_tokens for r in w) <= 4096


def test_goals_count_the_traces_within_each_backends_bounds() -> None:
    def row(fm, fp, tm, const=0.0):
        return {"fct": {"mean": fm, "p99": fp}, "ttft": {"mean": tm}, "ttft_fe_constant": {"mean": const}}

    rows = {"a": {"fidelity": "ok", "calibrated": {"flow": row(0.09, 0.14, 0.04, 0.07), "ns3": row(0.09, 0.05, 0.01)}},
            "b": {"fidelity": "ok", "calibrated": {"flow": row(-0.11, 0.0, 0.0), "ns3": row(0.01, -0.02, -0.06)}},
            "c": {"fidelity": "CPU idle median 9% < 10%", "calibrated": {"flow": row(0.0, 0.0, 0.0)}}}  # not counted
    out = bridge_suite.goals(rows)
    assert ("flow: FCT within 10% mean / 15% p99 on 1 of 2 traces; TTFT mean within 5% on 2 (front end as measured; "
            "with the fitted constant front end on 1 of 2); all three on 1") in out
    assert ("ns3: FCT within 5% mean / 10% p99 on 1 of 2 traces; TTFT mean within 5% on 1 (front end as measured; "
            "with the fitted constant front end on 2 of 2); all three on 0") in out
    cell = bridge_suite.table({"a": {"what": "w", "flows": 1, "fidelity": "ok", "slowdown_mean": 1.0, "raw": {},
                                     **rows["a"]}}, ["flow"])
    assert "+9.0% / +14.0% / +4.0% (+7.0%)" in cell  # the constant front end's TTFT error in brackets


def test_where_the_testbed_dropped_is_read_per_tier_or_marked_not_known(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"fidelity": {"valid": True}}))
    assert bridge_suite.run_facts(tmp_path)["drops_testbed_at"] is None  # no collected.json
    (tmp_path / "collected.json").write_text(json.dumps({"port_drops": {"leaf0:s1": 3, "l0h0:eth0": 0, "x:wg0": 1}}))
    assert bridge_suite.run_facts(tmp_path)["drops_testbed_at"] is None  # not a fabric port
    (tmp_path / "collected.json").write_text(json.dumps({"port_drops": {"leaf0:s1": 3, "l0h0:eth0": 0}}))
    at = bridge_suite.run_facts(tmp_path)["drops_testbed_at"]
    assert at == {"host_up": 0, "leaf_down": 0, "leaf_up": 3, "spine_down": 0}
    assert (bridge_suite.tiers(at), bridge_suite.tiers(dict.fromkeys(at, 0)), bridge_suite.tiers(None)) == \
        ("leaf_up 3", "none", "-")


def test_an_unknown_configuration_is_refused_by_name(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bridge_suite.py"), "--out", str(tmp_path),
                        "--configs", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no configuration named nope" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(netns_problem() is not None, reason=netns_problem() or "")
def test_one_configuration_end_to_end_each_trace_evaluated_on_the_others(tmp_path: Path) -> None:
    # two configurations of one fabric: each trace is fitted on the other configuration's
    # traces only, never on its twin of another mode
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bridge_suite.py"), "--out", str(tmp_path),
                        "--configs", "rack3-zipf-light,rack3-azure-heavy", "--requests", "10"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "suite.json").read_text())
    assert set(rows) == {"rack3-zipf-light/ecmp", "rack3-azure-heavy/ecmp", "rack3-azure-heavy/cc"}
    valid = {n for n, row in rows.items() if row["fidelity"] == "ok"}
    for name, row in rows.items():
        assert row["flows"] == 10 and row["fidelity"]
        assert set(row["raw"]) == {"flow", "ns3", "trivial"} and all(row["raw"].values())
        assert row["drops_testbed"] is not None and row["drops_ns3"] is not None
        # emulated P engines note when their server got each request: after the client sent it
        assert row["front_end_ms"] is not None and row["front_end_ms"] > 0 and row["cpu_idle"] is not None
        other = {n for n in valid if n.split("/")[0] != name.split("/")[0]}
        for b in ("flow", "ns3"):
            if other:
                assert set(row["calibrated"][b]["fit_on"]) == other
            else:
                assert b not in row.get("calibrated", {})
    md = (tmp_path / "suite.md").read_text()
    assert md.count("| rack3-azure-heavy/") == 2 and md.count("| rack3-zipf-light/") == 1
    # two repeats of one run: the repeats table reads every trace and sees no spread
    shutil.copytree(tmp_path, tmp_path.parent / "again")
    rep = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_repeats.py"), str(tmp_path),
                          str(tmp_path.parent / "again")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "COLUMNS": "300"})
    assert rep.returncode == 0, rep.stderr[-2000:]
    for name in rows:
        line = next(ln for ln in rep.stdout.splitlines() if name in ln)
        assert line.count("+0%") == 2  # mean and p99 of a run against itself
    assert "moved by more than 10% between repeats: 0" in rep.stdout


def test_the_repeats_table_needs_two_runs_and_says_so(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_repeats.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "give at least two suite directories" in r.stderr and "Traceback" not in r.stderr
    spec = importlib.util.spec_from_file_location("suite_repeats", ROOT / "benchmarks" / "suite_repeats.py")
    repeats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repeats)
    assert repeats.spread([2.0, 2.2, 2.1]) == pytest.approx(0.1)
    assert repeats.spread([1.0]) is None and repeats.spread([0.0, 1.0]) is None
    assert repeats.spread([1.0, float("nan")]) is None
    # one directory named twice is one run; two with no trace in common say so
    (tmp_path / "b").mkdir()
    for argv, said in (([tmp_path, f"{tmp_path}/"], "give at least two"), ([tmp_path, tmp_path / "b"], "no trace")):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_repeats.py"), *map(str, argv)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr
