"""``kvpath testbed run``'s table: one row per mode, its median over the repeats, and
the notes under it (ranges, path agreement, why a run is invalid).

The narrow view fits 80 columns (pairs of values share a cell: "mean/p99"); ``--wide``
adds min..max in every cell and the columns the narrow view leaves to the notes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from kvpath.testbed.repeats import Spread, aggregate, valid_count


def num(v: float | None, scale: float = 1e3) -> str:
    """A value in few characters: ms by default (3 significant digits, no exponent)."""
    if v is None:
        return "-"
    x = v * scale
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def pair(a: str, b: str) -> str:
    return f"{a}/{b}"


def ranged(sp: Spread, fmt: Callable[[float | None], str]) -> str:
    """``median (min..max)`` over several runs, the value alone for one."""
    if sp.n <= 1 or sp.lo == sp.hi:
        return fmt(sp.median)
    return f"{fmt(sp.median)} ({fmt(sp.lo)}..{fmt(sp.hi)})"


def _ratio(v: float | None) -> str:
    return num(v, 1.0)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def mode_table(by_mode: dict[str, list[dict[str, Any]]], unit: str, wide: bool) -> tuple[Table, list[str]]:
    """The table of one unit (testbed or datacenter time) and the notes under it."""
    # the narrow view: no vertical rules, one space between columns (80 columns hold it)
    t = (Table(title=f"per mode, {unit} time (ms)") if wide else
         Table(title=f"per mode, {unit} time (ms), medians over runs", box=box.SIMPLE_HEAD, pad_edge=False,
               collapse_padding=True))
    notes: list[str] = []
    cols = (["mode", "runs", "ok", "FCT mean", "FCT p99", "slowdown p50", "slowdown p99", "TTFT mean", "TTFT p99",
             "TPOT mean", "on reserved spine", "overhead", "CPU idle"] if wide else
            ["mode", "runs", "ok", "FCT mean/p99", "slow p50/p99", "TTFT mean/p99", "TPOT"])
    for c in cols:
        t.add_column(c, justify="left" if c in ("mode", "runs") else "right", no_wrap=True)
    for mode, ss in by_mode.items():
        a = aggregate(ss, unit)
        runs = valid_count(len(ss), sum(bool(s["fidelity"]["valid"]) for s in ss))
        runs = runs if runs != "INVALID" else "[red]INVALID[/red]"
        ok = f"{sum(s['ok'] for s in ss)}/{sum(s['requests'] for s in ss)}"
        if wide:
            t.add_row(mode, runs, ok, *(ranged(a[k], num) for k in ("fct_mean_s", "fct_p99_s")),
                      *(ranged(a[k], _ratio) for k in ("slowdown_p50", "slowdown_p99")),
                      *(ranged(a[k], num) for k in ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s")),
                      ranged(a["path_agreement"], _pct), ranged(a["push_overhead_s"], num),
                      ranged(a["cpu_idle_median"], _ratio))
        else:
            t.add_row(mode, runs, ok, pair(num(a["fct_mean_s"].median), num(a["fct_p99_s"].median)),
                      pair(_ratio(a["slowdown_p50"].median), _ratio(a["slowdown_p99"].median)),
                      pair(num(a["ttft_mean_s"].median), num(a["ttft_p99_s"].median)), num(a["tpot_mean_s"].median))
            notes.extend(_narrow_notes(mode, ss, a))
        notes.extend(_invalid_notes(mode, ss))
    return t, notes


def _narrow_notes(mode: str, ss: Sequence[dict[str, Any]], a: dict[str, Spread]) -> list[str]:
    """What the narrow view leaves out: the ranges over several runs, and the share of
    pushes on their reserved spine."""
    notes = []
    if len(ss) > 1:
        over = f"the {a['fct_mean_s'].n} valid" if a["fct_mean_s"].valid else f"all {len(ss)} (none valid)"
        notes.append(f"{mode}: min..max over {over} runs: FCT mean {ranged(a['fct_mean_s'], num)}, "
                     f"p99 {ranged(a['fct_p99_s'], num)}; TTFT mean {ranged(a['ttft_mean_s'], num)}, "
                     f"p99 {ranged(a['ttft_p99_s'], num)}; TPOT {ranged(a['tpot_mean_s'], num)}")
    agree = a["path_agreement"]
    if agree.median is not None:
        pushes = [s["pushes_with_path"] for s in ss]
        notes.append(f"{mode}: {ranged(agree, _pct)} of {'/'.join(map(str, pushes))} pushes on the reserved spine")
    return notes


def _invalid_notes(mode: str, ss: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for s in ss:
        name = mode if len(ss) == 1 else f"{mode} r{s.get('repeat', '?')}"
        out.extend(f"{name}: INVALID: {p}" for p in s["fidelity"]["problems"])
    return out


def print_summaries(by_mode: dict[str, list[dict[str, Any]]], console: Console, wide: bool = False) -> None:
    """Every unit's table with its notes; says so when each mode ran once."""
    for unit in ("testbed", "datacenter"):
        if not all(unit in s for ss in by_mode.values() for s in ss):
            continue
        t, notes = mode_table(by_mode, unit, wide)
        console.print(t)
        for n in notes:
            console.print(n, highlight=False)
    for mode, ss in by_mode.items():
        parts = (ss[0].get("datacenter") or ss[0].get("testbed") or {}).get("ttft_breakdown_s")
        if parts:
            unit = "datacenter" if "datacenter" in ss[0] else "testbed"
            shown = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v is not None)
            console.print(f"{mode}: where TTFT went ({unit} ms, medians{', first run' if len(ss) > 1 else ''}): "
                          f"{shown}", highlight=False)
    if all(len(ss) == 1 for ss in by_mode.values()):
        console.print("each mode ran once (--repeats N: medians and min..max over N rotated runs)")
