"""kvpath bridge sweep: the grid, inline vs processes vs Ray, failing points, argument errors, output files."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import pytest

from kvpath.bridge import serving_sim
from kvpath.bridge.cli import add_parsers
from kvpath.bridge.cli_sweep import points_from_args
from kvpath.bridge.sweep import COLUMNS, expand_grid, ray_package

# links slow enough (20 Gbit/s) that pushes overlap at 30 QPS, so modes and backends differ
SLOW_FABRIC = {"leaves": 4, "spines": 4, "hosts_per_leaf": 4, "host_link_gbps": 20.0, "spine_link_gbps": 20.0}
SMALL = ["--requests", "40", "--min-prompt", "1024", "--max-prompt", "2048"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parsers(p.add_subparsers())
    return p.parse_args(["bridge", "sweep", *argv])


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[dict]]:
    capsys.readouterr()
    args = _args([*argv, "--json"])
    rc = args.func(args)
    return rc, json.loads(capsys.readouterr().out)


def _metrics(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # wall time is the only non-determinism


@pytest.fixture(scope="module")
def slow_fabric(tmp_path_factory: pytest.TempPathFactory) -> str:
    p = tmp_path_factory.mktemp("fabric") / "slow.json"
    p.write_text(json.dumps(SLOW_FABRIC))
    return str(p)


def test_grid_dc_delays_only_on_dc_points() -> None:
    args = _args(["--qps", "2,6,10", "--dc-delay-s", "0,0.005", "--fabric", "rack4,rack8", "--backend",
                  "flow,trivial", "--mode", "ecmp,cc,dc"])
    points = points_from_args(args)
    # per (fabric, backend): ecmp 3 QPS + cc 3 QPS + dc 2 delays x 3 QPS = 12
    assert len(points) == 2 * 2 * 12
    assert [p.index for p in points] == list(range(len(points)))
    assert len({tuple(p.coords().values()) for p in points}) == len(points)
    for p in points:
        assert (p.dc_delay_s is None) == (p.mode != "dc")
    dc = [p for p in points if p.mode == "dc"]
    assert sorted({p.dc_delay_s for p in dc}) == [0.0, 0.005]
    assert len([p for p in points if p.mode == "ecmp"]) == 2 * 2 * 3
    # expansion order: fabric > pools > backend > mode > dc delay > QPS, each list as given
    assert [p.coords() for p in points[:4]] == [
        {"fabric": "rack4", "pools": "8P8D", "backend": "flow", "mode": "ecmp", "dc_delay_s": None, "qps": q}
        for q in (2.0, 6.0, 10.0)] + [
        {"fabric": "rack4", "pools": "8P8D", "backend": "flow", "mode": "cc", "dc_delay_s": None, "qps": 2.0}]


def test_grid_repeats_are_dropped_and_pools_is_a_list() -> None:
    pts = expand_grid(fabrics={"a": {}}, pools=["2P2D", "4P4D"], backends=["flow"], modes=["dc"],
                      dc_delays=[0.0, 0.001], qps=[1.0])
    assert [(p.pools, p.dc_delay_s) for p in pts] == [("2P2D", 0.0), ("2P2D", 0.001), ("4P4D", 0.0), ("4P4D", 0.001)]
    assert len(points_from_args(_args(["--qps", "2,2.0,2", "--mode", "ecmp,ecmp"]))) == 2  # 2 backends x 1 x 1


def test_processes_give_the_same_rows_as_inline_and_failing_points_are_rows(slow_fabric: str,
                                                                            capsys: pytest.CaptureFixture) -> None:
    grid = ["--qps", "10,30", "--dc-delay-s", "0,0.005", "--fabric", f"small,{slow_fabric}", "--pools", "2P2D,4P4D",
            "--backend", "flow,trivial", "--mode", "ecmp,dc", *SMALL]
    rc1, inline = _run([*grid, "--workers", "1"], capsys)
    rc2, parallel = _run([*grid, "--workers", "2"], capsys)
    assert len(inline) == 2 * 2 * 2 * 3 * 2
    assert _metrics(parallel) == _metrics(inline)
    # small (2 leaves of 2 hosts) holds 2P2D but not 4P4D: those points fail, the others run
    bad = [r for r in inline if r["fabric"] == "small" and r["pools"] == "4P4D"]
    good = [r for r in inline if r not in bad]
    assert len(bad) == 12 and rc1 == rc2 == 1
    for r in bad:
        assert "do not fit" in r["error"] and r["fct_mean_s"] is None and r["wall_s"] is None
    for r in good:
        assert r["error"] is None and r["requests"] == 40 and r["fct_mean_s"] > 0
        assert r["ttft_p99_s"] >= r["ttft_mean_s"]
    # the comparison means something: the slow fabric's rows are not all alike
    assert len({r["fct_mean_s"] for r in good if r["fabric"] == slow_fabric}) > 1
    # rows come back in grid order whatever order they finished in
    assert [r["qps"] for r in inline[:2]] == [10.0, 30.0] and inline[0]["fabric"] == "small"


def test_a_sweep_without_failures_exits_0(capsys: pytest.CaptureFixture) -> None:
    rc, rows = _run(["--fabric", "rack4", "--pools", "2P2D", "--mode", "ecmp", "--backend", "trivial", "--workers",
                     "1", *SMALL], capsys)
    assert rc == 0 and len(rows) == 1 and rows[0]["error"] is None


def test_table_output(capsys: pytest.CaptureFixture) -> None:
    args = _args(["--fabric", "small", "--pools", "2P2D,4P4D", "--mode", "ecmp", "--backend", "trivial", "--workers",
                  "1", *SMALL])
    capsys.readouterr()
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "FCT mean/p99" in out and "failed" in out and "1 point(s) failed: ValueError: pools 4P4D do not fit" in out


@pytest.mark.parametrize("argv, flag", [
    (["--backend", "flow,bogus"], "--backend"),
    (["--mode", "ecmp,nope"], "--mode"),
    (["--fabric", "rack4,nowhere"], "--fabric"),
    (["--qps", "0"], "--qps"),
    (["--qps", "2,x"], "--qps"),
    (["--qps", ","], "--qps"),
    (["--dc-delay-s", "-1"], "--dc-delay-s"),
    (["--pools", "8x8"], "--pools"),
    (["--workers", "0"], "--workers"),
    (["--requests", "0"], "--requests"),
    (["--lanes", "0"], "--lanes"),
    (["--workload", "no-such-workload"], "--workload"),
    (["--model", "no-such-model"], "--model"),
])
def test_argument_errors_name_the_flag(argv: list[str], flag: str) -> None:
    args = _args(argv)
    with pytest.raises(SystemExit) as e:
        args.func(args)
    msg = str(e.value.code)
    assert msg.startswith("kvpath bridge sweep: error: ") and flag in msg


def test_backends_are_the_ones_serving_config_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """No list of backends in the sweep: one that ServingConfig accepts (e.g. a new ns3) is accepted."""
    validate = serving_sim.ServingConfig.validate

    def accepting_ns3(self: serving_sim.ServingConfig, spec) -> None:
        if self.backend != "ns3":
            validate(self, spec)

    monkeypatch.setattr(serving_sim.ServingConfig, "validate", accepting_ns3)
    points = points_from_args(_args(["--backend", "flow,ns3", "--mode", "ecmp"]))
    assert [p.backend for p in points] == ["flow", "ns3"]


@pytest.mark.parametrize("name", ["rows.csv", "rows.jsonl"])
def test_out_files(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sub" / name
    args = _args(["--fabric", "small", "--pools", "2P2D,4P4D", "--mode", "ecmp,dc", "--dc-delay-s", "0.001",
                  "--backend", "trivial", "--workers", "1", "--out", str(out), *SMALL])
    assert args.func(args) == 1
    if name.endswith(".csv"):
        with out.open() as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        assert tuple(reader.fieldnames) == COLUMNS
        assert [r["dc_delay_s"] for r in rows] == ["", "0.001", "", "0.001"]  # not a coordinate of ecmp points
        assert rows[0]["error"] == "" and float(rows[0]["fct_mean_s"]) > 0
        assert "do not fit" in rows[2]["error"] and rows[2]["fct_mean_s"] == ""
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert all(tuple(r) == COLUMNS for r in rows)
        assert [r["dc_delay_s"] for r in rows] == [None, 0.001, None, 0.001]
        assert rows[0]["error"] is None and "do not fit" in rows[2]["error"] and rows[2]["fct_mean_s"] is None
    assert len(rows) == 4


def test_ray_missing_names_the_flag_and_the_requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    args = _args(["--ray", "local", "--fabric", "rack4", "--pools", "2P2D", "--mode", "ecmp", "--backend", "trivial",
                  *SMALL])
    with pytest.raises(SystemExit) as e:
        args.func(args)
    assert "--ray" in str(e.value.code) and "pip install -r requirements/ray.txt" in str(e.value.code)


def test_ray_local_gives_the_same_rows_as_inline(slow_fabric: str, capsys: pytest.CaptureFixture) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -r requirements/ray.txt)")
    grid = ["--qps", "30", "--dc-delay-s", "0,0.005", "--fabric", f"small,{slow_fabric}", "--pools", "4P4D",
            "--backend", "flow,trivial", "--mode", "ecmp,cc,dc", *SMALL]
    _, inline = _run([*grid, "--workers", "1"], capsys)
    # --ray local --workers 2: ray.init(num_cpus=2, include_dashboard=False), shut down at the end
    rc, on_ray = _run([*grid, "--ray", "local", "--workers", "2"], capsys)
    assert not ray.is_initialized()
    assert rc == 1 and len(on_ray) == 2 * 2 * 4
    assert _metrics(on_ray) == _metrics(inline)
    assert sum(1 for r in on_ray if r["error"]) == 8  # small does not hold 4P4D


def test_scale_s_reaches_every_point():
    # KV bytes / 4 on the same links: every flow is 4x shorter, so the mean FCT drops
    from kvpath.bridge.sweep import run_point

    rows = {}
    for s in ("1", "4"):
        args = _args(["--fabric", "small", "--pools", "2P2D", "--requests", "12", "--qps", "5",
                      "--backend", "trivial", "--mode", "ecmp", "--scale-s", s])
        (pt,) = points_from_args(args)
        assert pt.scale_s == float(s)
        rows[s] = run_point(pt)
    assert rows["4"]["fct_mean_s"] < rows["1"]["fct_mean_s"] / 3


def test_the_ray_package_imports_the_bridge_as_kvpath_bridge(tmp_path: Path) -> None:
    """What --ray ADDRESS ships (py_modules): kvpath with the bridge inside, importable with
    neither this checkout nor its editable install on the path."""
    import subprocess

    pkg = ray_package(tmp_path)
    assert pkg.name == "kvpath" and (pkg / "bridge" / "sweep.py").is_file() and not list(pkg.rglob("__pycache__"))
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', '')]; "
            f"sys.path.insert(0, {str(tmp_path)!r}); import kvpath.bridge.sweep as s; print(s.__file__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "bridge" / "sweep.py")
