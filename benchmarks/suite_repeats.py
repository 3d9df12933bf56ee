"""How much the testbed itself moves between repeats of the validation suite, next to
how much each backend's calibrated error moves.

    .venv/bin/python benchmarks/suite_repeats.py /tmp/s19 /tmp/s20 [...]

Each argument is a ``bridge_suite.py --out`` directory. The suite's configurations are
seeded: a repeat sends the same requests at the same times, so what differs between
runs of one configuration is the machine (CPU contention, the ECMP hash of fresh
ports, which flows happen to meet). Per trace present in at least two runs it prints
the measured mean and p99 FCT of each run and their spread (max / min - 1), and each
backend's calibrated mean / p99 FCT error per run (from ``suite.json``, which also
marks the runs the fidelity check found invalid). A p99 that
moves by more than a goal between repeats bounds what any simulator replaying one run
can be held to on that configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpath.trace import read_trace
from kvpath.trace.metrics import TraceMetrics


def spread(values: list[float]) -> float | None:
    """max / min - 1: how far apart the repeats are; None unless there are two or more
    values, all finite and positive."""
    if len(values) < 2 or not all(math.isfinite(v) and v > 0 for v in values):
        return None
    return max(values) / min(values) - 1


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def measured(run: Path) -> dict[str, tuple[float, float]]:
    """Trace name (``config/mode``) -> (mean, p99) of its measured FCTs in seconds."""
    out = {}
    for path in sorted(run.glob("*/*/trace.jsonl")):
        m = TraceMetrics.of(read_trace(path))
        if m.fct_mean_s is not None and m.fct_p99_s is not None:  # a trace without flows has none
            out[f"{path.parent.parent.name}/{path.parent.name}"] = (m.fct_mean_s, m.fct_p99_s)
    return out


def suite_rows(run: Path) -> tuple[set[str], dict[str, dict[str, tuple[float, float]]]]:
    """From the run's suite.json: the traces its fidelity check marked invalid, and trace
    name -> backend -> (mean, p99) calibrated FCT error (neither without a readable one)."""
    path = run / "suite.json"
    if not path.exists():
        return set(), {}
    try:
        rows = json.loads(path.read_text())
        return ({name for name, row in rows.items() if row["fidelity"] != "ok"},
                {name: {b: (c["fct"]["mean"], c["fct"]["p99"]) for b, c in row.get("calibrated", {}).items()}
                 for name, row in rows.items()})
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        logging.warning("%s: not a suite's table (%s): its fidelity and calibrated errors are left out", path, e)
        return set(), {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bridge_suite.py --out directories")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console, errors = Console(), Console(stderr=True)
    runs = list(dict.fromkeys(r.resolve() for r in args.runs))  # one directory named twice is one run
    missing = [str(r) for r in runs if not r.is_dir()]
    if missing or len(runs) < 2:
        errors.print(f"[red]error:[/] runs: give at least two suite directories (missing: {', '.join(missing) or '-'})")
        return 2
    meas = {r: measured(r) for r in runs}
    bad, cal = {}, {}
    for r in runs:
        bad[r], cal[r] = suite_rows(r)
    backends = sorted({b for c in cal.values() for row in c.values() for b in row})
    names = sorted({n for m in meas.values() for n in m})
    table = Table(title="repeats of the suite: measured FCT mean / p99 (ms), spread; calibrated error per run")
    for col in ["trace", "runs", "mean (ms)", "spread", "p99 (ms)", "spread"] + [f"{b} mean / p99" for b in backends]:
        table.add_column(col)
    wide = shown = 0
    for name in names:
        present = [r for r in runs if name in meas[r]]
        if len(present) < 2:
            continue
        means = [meas[r][name][0] * 1e3 for r in present]
        p99s = [meas[r][name][1] * 1e3 for r in present]
        wide += (spread(p99s) or 0) > 0.10
        shown += 1
        cells = []
        for b in backends:
            errs = [cal[r].get(name, {}).get(b) for r in present]
            cells.append(", ".join("-" if e is None else f"{e[0]:+.1%} / {e[1]:+.1%}" for e in errs))
        mark = ["*" if name in bad[r] else "" for r in present]
        table.add_row(name, str(len(present)), " ".join(f"{m:.1f}{x}" for m, x in zip(means, mark)), pct(spread(means)),
                      " ".join(f"{p:.1f}{x}" for p, x in zip(p99s, mark)), pct(spread(p99s)), *cells)
    if not shown:
        errors.print("[red]error:[/] runs: no trace (CONFIG/MODE/trace.jsonl) is in two of them")
        return 2
    console.print(table)
    console.print("*: a run the fidelity check marked invalid (shown, counted in the spread)")
    console.print(f"traces whose measured p99 FCT moved by more than 10% between repeats: {wide}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
