"""``kvpath demo`` on real parts: the quick profile end to end (testbed, bridge, table,
report), interrupted mid-run (nothing left behind), and the simulation alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from kvpath.demo.profiles import QUICK
from kvpath.demo.rows import replay_rows
from kvpath.testbed.netns_fabric import down, leftovers, netns_problem

_why = netns_problem()
needs_netns = pytest.mark.skipif(_why is not None, reason=_why or "")
DEMO = [sys.executable, "-m", "kvpath.cli", "demo", "--quick"]
LABELS = [v.label for v in QUICK.variants]


def _run(argv: list[str], timeout: float = 480) -> subprocess.CompletedProcess:
    """The demo to its end; past ``timeout`` (below pytest's own 600 s) it gets SIGTERM, so it
    still tears its fabric down, and SIGKILL only if that does not end it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture
def no_leftovers():
    """Whatever the test's outcome, no namespace of a demo it started outlives it."""
    before = set(leftovers())
    yield before
    for name in set(leftovers()) - before:
        down(name)


def _rows(out: Path) -> dict[tuple[str, str], dict]:
    doc = json.loads((out / "demo.json").read_text())
    return {(r["variant"], r["source"]): r for r in doc["rows"]}


@needs_netns
def test_the_quick_demo_measures_every_variant_replays_it_and_writes_the_report(tmp_path, no_leftovers):
    before = no_leftovers
    out = tmp_path / "demo"
    r = _run([*DEMO, "--out", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _rows(out)
    for label in LABELS:
        for source in ("measured", "flow", "flow, cal."):
            row = rows[(label, source)]
            assert all(v[0] is not None and v[0] > 0 for v in row["values_s"].values()), row
        assert rows[(label, "measured")]["note"].startswith(("valid", "INVALID"))
        assert all(rows[(label, "flow")]["errors"][q] is not None for q in ("fct", "ttft", "tpot"))
        summary = json.loads((out / label / "summary.json").read_text())
        assert (summary["requests"], summary["failed"]) == (QUICK.requests, 0)
    # each variant ran its own mode and policy
    for v in QUICK.variants:
        cfg = json.loads((out / v.label / "collected.json").read_text())["config"]
        assert (cfg["mode"], cfg["policy"]) == (v.mode, v.policy)
    assert "measured (testbed) against simulated" in r.stdout and "report: " in r.stdout
    index = out / "report" / "index.html"
    html = index.read_text()
    assert all(label in html for label in LABELS)
    assert [p for p in (out / "report").glob("*.png") if p.stat().st_size > 1000]
    assert set(leftovers()) <= before


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_tears_down_the_fabric_and_every_process(tmp_path, sig, no_leftovers):
    before = no_leftovers
    out = tmp_path / "demo"
    proc = subprocess.Popen([*DEMO, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "lanes open and registered" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    children: list[psutil.Process] = []
    try:
        assert ready.wait(240), "".join(lines)[-3000:]
        time.sleep(2)  # the workload is being driven now
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # the proxy and the engines (2 P + 2 D) at least
        assert set(leftovers()) - before  # the fabric is up
        proc.send_signal(sig)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:  # the test failed before the signal: end it cleanly, then for sure
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            for c in children:
                if c.is_running():
                    c.kill()
    assert rc == 128 + sig, "".join(lines)[-3000:]
    assert "interrupted" in "".join(lines)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
    assert set(leftovers()) <= before


def test_the_simulation_runs_alone_where_no_fabric_can_be_built(tmp_path):
    out = tmp_path / "demo"
    r = _run([*DEMO, "--simulate-only", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no fabric (--simulate-only): running the simulation part alone" in r.stdout
    doc = json.loads((out / "demo.json").read_text())
    assert doc["measured"] is False
    # every variant, its policy by the simulation's own placement (cc+lo: load, cc+joint: joint)
    assert [(row["variant"], row["source"]) for row in doc["rows"]] == [
        (v, "flow (simulated only)") for v in ("ecmp", "cc", "cc+lo", "cc+joint")]
    assert (out / "report" / "index.html").exists()


class _Replayed:
    def __init__(self, fct, ttft, tpot):
        self.fct, self.ttft, self.tpot = fct, ttft, tpot


def test_rows_give_values_in_datacenter_time_and_errors_as_simulated_over_measured():
    meas, sim = np.array([2.0, 4.0]), np.array([3.0, 6.0])
    rep = _Replayed((meas, sim), (meas * 10, sim * 10), None)
    measured, flow = replay_rows("cc", [("flow", rep)], scale=2.0, note="valid")
    assert measured.source == "measured" and measured.note == "valid"
    assert measured.values["fct"][0] == pytest.approx(1.5)  # mean 3 s of testbed time / (B/S = 2)
    assert flow.values["fct"][0] == pytest.approx(2.25)
    assert flow.errors["fct"] == pytest.approx((0.5, 0.5))
    assert flow.errors["tpot"] is None and flow.values["tpot"] == (None, None)


def test_a_failed_step_ends_with_one_error_line_not_a_traceback(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("")
    r = subprocess.run([*DEMO, "--simulate-only", "--out", str(taken)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "kvpath demo: error:" in r.stdout and "Traceback" not in r.stdout + r.stderr
