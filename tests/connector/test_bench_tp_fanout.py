"""benchmarks/bench_tp_fanout.py: a short run gives every method x operation x TP row with sane numbers,
and a bad option fails in one line with exit code 2. No timing is asserted (shared, noisy cores)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_tp_fanout.py"
METHODS = ("vllm-mq", "sequential", "threads", "asyncio")
OPERATIONS = ("registration", "push-start")
TEXT = ("method", "operation")


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_a_short_run_gives_every_row_with_sane_numbers(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    r = _run("--tp", "1,2", "--ops", "50", "--warmup", "10", "--json", str(out), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(row["method"], row["operation"], row["tp"]): row for row in data["rows"]}
    assert len(rows) == len(data["rows"])
    assert set(rows) == {(m, o, tp) for m in METHODS for o in OPERATIONS for tp in (1, 2)}
    for key, row in rows.items():
        assert row["ops"] == 50, key
        numbers = {k: v for k, v in row.items() if k not in (*TEXT, "tp", "ops")}
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in numbers.values()), (key, row)
        assert row["min_us"] <= row["mean_us"] <= row["max_us"], (key, row)
        assert row["p95_us"] <= row["max_us"], (key, row)
        assert row["coordinator_cpu_per_op_us"] <= row["cpu_per_op_us"], (key, row)
    for k in ("wall_s", "ours_cores", "others_cores", "steal_cores"):
        assert math.isfinite(data[k]) and data[k] >= 0, k
    # the table: a line per row, on stdout; the log stays on stderr
    assert sum(line.count("registration") for line in r.stdout.splitlines()) == len(METHODS) * 2
    assert "WARNING" not in r.stdout


@pytest.mark.parametrize("argv, option", [
    (["--tp", "1,x"], "--tp"),
    (["--tp", "16"], "--tp"),
    (["--ops", "0"], "--ops"),
    (["--methods", "pigeon"], "--methods"),
    (["--frobnicate"], "--frobnicate"),
])
def test_a_bad_option_fails_in_one_line_naming_it(argv: list[str], option: str) -> None:
    r = _run(*argv, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("bench_tp_fanout.py: error:") and option in lines[0], lines[0]
