"""The fidelity envelope, repeats and the calibration's choice of run: stored runs of the
quick demo (``tests/data/envelope``: a quiet one, and one with a one-core busy loop
beside its ecmp run) replayed through the envelope, the rotation of repeats, the
aggregation over them, and a calibration that never fits on a disturbed run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvpath.demo.profiles import QUICK
from kvpath.demo.steps import Measured, calibration_base, replay
from kvpath.testbed import envelope
from kvpath.testbed.repeats import aggregate, rotation, run_dir, spread, valid_count
from kvpath.trace import read_trace

DATA = Path(__file__).parents[1] / "data" / "envelope"
LABELS = ("ecmp", "cc", "cc+lo")


def _unjudged(path: Path) -> dict:
    """A stored summary with the verdict the envelope gave it taken out again (what
    run_report.fidelity alone said)."""
    s = json.loads(path.read_text())
    env = s["fidelity"].pop("envelope", None) or {"problems": []}
    s["fidelity"]["problems"] = [p for p in s["fidelity"]["problems"] if p not in env["problems"]]
    s["fidelity"]["valid"] = not s["fidelity"]["problems"]
    return s


def _run(name: str) -> list[dict]:
    """A stored demo run's summaries, unjudged, in the demo's order."""
    return [_unjudged(DATA / name / label / "summary.json") for label in LABELS]


def test_the_stored_disturbed_run_is_flagged_and_the_quiet_one_is_not():
    quiet, disturbed = _run("quiet"), _run("disturbed")
    # run_report's own checks passed both: the busy loop left the CPU far from saturated
    assert all(s["fidelity"]["valid"] for s in quiet + disturbed)
    assert envelope.judge(quiet) == [[], [], []]
    verdicts = envelope.judge(disturbed)
    assert verdicts[1:] == [[], []]
    assert len(verdicts[0]) == 1 and verdicts[0][0].startswith("CPU idle median")
    envelope.apply(disturbed)
    assert [s["fidelity"]["valid"] for s in disturbed] == [False, True, True]
    assert disturbed[0]["fidelity"]["envelope"]["problems"] == verdicts[0]
    envelope.apply(disturbed)  # judged again: the same verdict, not its problems twice
    assert disturbed[0]["fidelity"]["problems"] == verdicts[0]


def test_the_stored_full_profile_repeats_flag_the_two_disturbed_runs_only():
    # kvpath demo --no-ns3 --repeats 2: a one-core busy loop beside cc r1; ecmp r1 shared
    # the machine with something not identified (CPU idle 39%, dips to 16%)
    names = ["ecmp/r1", "cc/r1", "cc+lo/r1", "cc/r2", "cc+lo/r2", "ecmp/r2"]  # the rotated order they ran in
    runs = [_unjudged(DATA / "full-busy" / n / "summary.json") for n in names]
    assert all(s["fidelity"]["valid"] for s in runs)
    flagged = [n for n, p in zip(names, envelope.judge(runs)) if p]
    assert flagged == ["ecmp/r1", "cc/r1"]


def _with(s: dict, overhead: float | None = None, tpot: float | None = None, idle: float | None = None) -> dict:
    s = copy.deepcopy(s)
    if overhead is not None:
        s["push_overhead_s"] = overhead
    if tpot is not None:
        s["datacenter"]["tpot_s"]["mean"] = s["tpot_model_s"] * tpot
    if idle is not None:
        s["fidelity"]["cpu_idle_median"] = idle
    return s


def test_the_envelope_judges_overhead_and_tpot_alone_and_against_the_other_runs():
    q = _run("quiet")[0]
    assert envelope.judge([q]) == [[]]  # alone: the absolute bounds only
    (alone,) = envelope.judge([_with(q, overhead=0.0125)])  # the filed disturbed run's overhead
    assert alone and "per-push overhead 12.5 ms" in alone[0]
    # above twice the others' median though under the absolute bound
    peers = [_with(q, overhead=0.001), _with(q, overhead=0.001), _with(q, overhead=0.0035)]
    assert [bool(p) for p in envelope.judge(peers)] == [False, False, True]
    assert "median" in envelope.judge(peers)[2][0]
    assert envelope.judge([_with(q, tpot=1.3)])[0][0].startswith("TPOT 1.30 x")
    slow = envelope.judge([q, q, _with(q, tpot=1.16)])  # 9.5 against 8.2 ms, the filed run's TPOT
    assert [bool(p) for p in slow] == [False, False, True]
    # too few lone pushes: the overhead is not measured, so not judged
    assert envelope.judge([_with(dict(q, lone_pushes=2), overhead=0.05)]) == [[]]
    # real engines: no absolute overhead bound (measured on emulated ones), the peers' still
    assert envelope.judge([_with(dict(q, engine="vllm"), overhead=0.0125)]) == [[]]
    # idle judged only against peers that had room to spare
    assert envelope.judge([_with(q, idle=8.0), _with(q, idle=15.0), _with(q, idle=5.0)]) == [[], [], []]
    # another connector's runs are no peers: vLLM's in-tree pull connector spins a core
    vq = dict(q, engine="vllm", connector="kvpath")
    mixed = [_with(vq, idle=80.0), _with(vq, idle=78.0), _with(dict(vq, connector="nixl"), idle=30.0)]
    assert envelope.judge(mixed) == [[], [], []]
    assert envelope.judge(mixed[:2] + [_with(vq, idle=30.0)])[2][0].startswith("CPU idle median")


def test_repeats_rotate_so_every_variant_takes_every_place():
    order = rotation(["A", "B", "C"], 3)
    assert [x for _, x in order] == list("ABCBCACAB")
    assert [r for r, _ in order] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [x for _, x in rotation(["A", "B"], 3)] == list("ABBAAB")
    assert rotation(["A", "B", "C"], 1) == [(1, "A"), (1, "B"), (1, "C")]
    assert run_dir("out", "cc", 1, 1) == Path("out/cc")  # one repeat: the layout before repeats
    assert run_dir("out", "cc", 2, 3) == Path("out/cc/r2")


def test_aggregation_is_over_the_valid_repeats_and_counts_them():
    sp = spread([10.0, 30.0, 12.0, 11.0], [True, False, True, True])
    assert (sp.median, sp.lo, sp.hi, sp.n, sp.runs, sp.valid) == (11.0, 10.0, 12.0, 3, 4, 3)
    none = spread([10.0, 30.0], [False, False])  # none valid: over all, and it says 0 valid
    assert (none.median, none.lo, none.hi, none.valid) == (20.0, 10.0, 30.0, 0)
    assert valid_count(5, 3) == "3/5 valid" and valid_count(1, 1) == "valid" and valid_count(1, 0) == "INVALID"
    runs = _run("quiet")[:1] * 2 + _run("disturbed")[:1]
    envelope.apply(runs)
    a = aggregate(runs, "datacenter")
    assert (a["fct_p99_s"].runs, a["fct_p99_s"].valid) == (3, 2)
    assert a["fct_p99_s"].median == pytest.approx(runs[0]["datacenter"]["fct_s"]["p99"])  # the disturbed one left out


def _measured(name: str, repeat: int) -> Measured:
    s = _run(name)
    envelope.apply(s)
    folder = DATA / name / "ecmp"
    return Measured(QUICK.variants[0], read_trace(folder / "trace.jsonl"), s[0], repeat, folder)


def test_calibration_is_fitted_on_the_first_valid_run_never_a_disturbed_one():
    disturbed, quiet = _measured("disturbed", 1), _measured("quiet", 2)
    assert not disturbed.valid and quiet.valid
    assert calibration_base([disturbed, quiet], "ecmp") is quiet
    assert calibration_base([disturbed], "ecmp") is None
    res = replay([disturbed], [], Console(quiet=True))
    assert any(n.startswith("no calibration: no run of ecmp is valid") for n in res.notes)
    assert any("INVALID: CPU idle median" in n for n in res.notes)
