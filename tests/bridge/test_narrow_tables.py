"""Every table a person reads (the demo's, ``kvpath testbed run``'s, the bridge's) fits an
80-column terminal: rendered at width 80, no cell is cut to "…". The wide view (``--wide``)
keeps every column."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from rich.console import Console

from kvpath.bridge.cli_sweep import sweep_table
from kvpath.bridge.tables import across_table, calibrate_table, compare_table, simulate_table
from kvpath.demo.rows import combine, replay_rows, table
from kvpath.testbed.run_table import print_summaries

DATA = Path(__file__).parents[1] / "data" / "envelope"


def _render(*things, width: int = 80) -> str:
    c = Console(width=width, record=True, color_system=None)
    for t in things:
        c.print(t)
    return c.export_text()


def _assert_fits(text: str) -> None:
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text


class _Replayed:
    def __init__(self, k: float):
        meas = np.array([0.0123, 0.0456, 0.1789]) * 4
        self.fct = (meas, meas * k)
        self.ttft = (meas * 10, meas * 10 * k)
        self.tpot = (meas / 3, meas / 3 * k)


def _demo_rows(repeats: int):
    per_variant = []
    for label, verdict in (("ecmp", "valid"), ("cc", "INVALID"), ("cc+lo", "valid")):
        runs = [replay_rows(label, [("flow", _Replayed(0.87)), ("flow, cal.", _Replayed(1.02)),
                                    ("ns3", _Replayed(1.234))], 4.0, verdict, failed=2 if label == "cc" else 0)
                for _ in range(repeats)]
        per_variant += combine(runs, [verdict == "valid"] * repeats)
    return per_variant


def test_the_demo_table_fits_80_columns_for_one_run_and_for_repeats():
    for repeats in (1, 3):
        _assert_fits(_render(table(_demo_rows(repeats), "measured rows: datacenter-equivalent ms; simulated rows: "
                                                        "error, simulated / measured - 1")))
    wide = _render(table(_demo_rows(3), "t", wide=True), width=250)
    assert "…" not in wide and "FCT err" in wide


def _summaries() -> dict[str, list[dict]]:
    return {p.parent.name: [json.loads(p.read_text())] for p in sorted((DATA / "quiet").glob("*/summary.json"))}


def test_the_testbed_run_table_fits_80_columns_for_one_run_and_for_repeats():
    one = _summaries()
    assert len(one) == 3
    c = Console(width=80, record=True, color_system=None)
    print_summaries(one, c)
    text = c.export_text()
    _assert_fits(text)
    assert "each mode ran once" in text
    many = {m: [copy.deepcopy(ss[0]) for _ in range(3)] for m, ss in one.items()}
    many["cc"][1]["fidelity"].update(valid=False, problems=["CPU idle median 40% < 0.6 x the other runs' median"])
    c = Console(width=80, record=True, color_system=None)
    print_summaries(many, c)
    text = c.export_text()
    _assert_fits(text)
    assert "2/3 valid" in text and "cc r" in text


def _held(a: float, b: float):
    return SimpleNamespace(before=SimpleNamespace(mean=a, p99=-a, bias=a / 2), after=SimpleNamespace(mean=b, p99=-b,
                                                                                                     bias=b / 2))


def test_the_bridge_tables_fit_80_columns():
    e = SimpleNamespace(n=1234, mean=-0.123, p50=-0.456, p99=1.234, bias=-0.0712, mean_abs=0.3456)
    errors = {"flow": {"fct": e, "ttft": e, "tpot": e}, "ns3": {"fct": e, "ttft": e, "tpot": None}}
    held = [(q, _held(-0.345, 0.012)) for q in ("fct", "ttft", "tpot")]
    ev = [SimpleNamespace(name="runs/rack4-os2-seed-3/ecmp/trace.jsonl", fct=_held(-0.5, 0.1), ttft=_held(0.2, 0.01),
                          tpot=_held(-0.01, 0.0))] * 2
    across, names = across_table("flow: fitted on 2 trace(s), 12 network runs; error on each evaluated trace", ev,
                                 False)
    sim = [{"backend": b, "mode": m, "fct_mean_s": 0.01234, "fct_p99_s": 0.1234, "slowdown_mean": 1.23,
            "ttft_mean_s": 0.2345, "tpot_mean_s": 0.00812, "wall_s": 12.34} for b in ("flow", "ns3")
           for m in ("ecmp", "cc", "dc")]
    grid = [{"fabric": "rack4", "pools": "8P8D", "backend": b, "mode": m, "dc_delay_s": d, "qps": q,
             "fct_mean_s": 0.01234, "fct_p99_s": 0.1234, "slowdown_mean": 1.23, "ttft_mean_s": 0.2345,
             "ttft_p99_s": 1.2345, "tpot_mean_s": 0.00812, "wall_s": 12.34, "error": None}
            for b in ("flow", "ns3") for m in ("ecmp", "dc") for d in (0.0, 0.001) for q in (10.0, 20.0)]
    text = _render(compare_table("simulated vs measured (ecmp, 1234 flows): relative error", errors, False),
                   calibrate_table("flow: held-out error (150 requests; fitted on the first 150 by arrival, 40 "
                                   "network runs)", held, False),
                   across, simulate_table("simulated: rack4, 8P8D, 500 requests at 20.0 QPS (ms)", sim, False),
                   sweep_table(grid, "sweep: zipf, 500 requests, llama-3-8b on h100 (ms)"))
    _assert_fits(text)
    assert names == ["#1: runs/rack4-os2-seed-3/ecmp/trace.jsonl", "#2: runs/rack4-os2-seed-3/ecmp/trace.jsonl"]
    wide = _render(compare_table("t", errors, True), calibrate_table("t", held, True),
                   across_table("t", ev, True)[0], simulate_table("t", sim, True), sweep_table(grid, "t", True),
                   width=250)
    assert "…" not in wide and "|error| (mean)" in wide and "mean before" in wide
