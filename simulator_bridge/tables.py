"""The bridge commands' tables (``compare``, ``calibrate``, ``simulate``), narrow or wide.

The narrow view fits an 80-column terminal: short headers, no vertical rules, pairs of
values in one cell ("raw -> cal.", "mean/p99"), long names (trace paths) replaced by a
number with the names under the table. ``--wide`` prints every column as before.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich import box
from rich.table import Table


def pct(v: float) -> str:
    return f"{100 * v:+.1f}%"


def _table(title: str, wide: bool) -> Table:
    if wide:
        return Table(title=title)
    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def _arrow(a: float, b: float) -> str:
    return f"{pct(a)} -> {pct(b)}"


def compare_table(title: str, errors: dict[str, dict[str, Any]], wide: bool) -> Table:
    """Per backend and quantity, the relative errors (``compare.Errors``)."""
    t = _table(title, wide)
    cols = (("backend", "quantity", "n", "mean", "p50", "p99", "bias (median)", "|error| (mean)") if wide else
            ("backend", "qty", "n", "mean", "p50", "p99", "bias", "|err|"))
    for c in cols:
        t.add_column(c, no_wrap=True, justify="left" if c in ("backend", "quantity", "qty") else "right")
    for b, row in errors.items():
        for q, e in row.items():
            if e is not None:
                t.add_row(b, q.upper(), str(e.n), *(pct(v) for v in (e.mean, e.p50, e.p99, e.bias)),
                          f"{100 * e.mean_abs:.1f}%")
    return t


def calibrate_table(title: str, held: Sequence[tuple[str, Any]], wide: bool) -> Table:
    """Per quantity (name, ``calibrate.Held``), the held-out error before and after."""
    t = _table(title, wide)
    cols = (("quantity", "mean before", "mean after", "p99 before", "p99 after", "bias after") if wide else
            ("qty", "mean: raw -> cal.", "p99: raw -> cal.", "bias cal."))
    for c in cols:
        t.add_column(c, no_wrap=True, justify="left" if c in ("quantity", "qty") else "right")
    for q, h in held:
        if wide:
            t.add_row(q.upper(), pct(h.before.mean), pct(h.after.mean), pct(h.before.p99), pct(h.after.p99),
                      pct(h.after.bias))
        else:
            t.add_row(q.upper(), _arrow(h.before.mean, h.after.mean), _arrow(h.before.p99, h.after.p99),
                      pct(h.after.bias))
    return t


def across_table(title: str, evaluated: Sequence[Any], wide: bool) -> tuple[Table, list[str]]:
    """Per evaluated trace and quantity, the error before and after; narrow: traces by
    number, their names in the returned notes."""
    t = _table(title, wide)
    cols = (("trace", "quantity", "mean before", "mean after", "p99 before", "p99 after") if wide else
            ("trace", "qty", "mean: raw -> cal.", "p99: raw -> cal."))
    for c in cols:
        t.add_column(c, no_wrap=True, justify="left" if c in ("trace", "quantity", "qty") else "right")
    notes = []
    for i, e in enumerate(evaluated, 1):
        name = e.name if wide else f"#{i}"
        if not wide:
            notes.append(f"#{i}: {e.name}")
        for q in ("fct", "ttft", "tpot"):
            h = getattr(e, q)
            if wide:
                t.add_row(name, q.upper(), pct(h.before.mean), pct(h.after.mean), pct(h.before.p99), pct(h.after.p99))
            else:
                t.add_row(name, q.upper(), _arrow(h.before.mean, h.after.mean), _arrow(h.before.p99, h.after.p99))
    return t, notes


def _ms(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v * 1e3:.{digits}f}"


def simulate_table(title: str, rows: Sequence[dict[str, Any]], wide: bool) -> Table:
    """One row per (backend, mode): ``serving_sim.summarize``'s figures in ms."""
    t = _table(title, wide)
    cols = (("backend", "mode", "FCT mean", "FCT p99", "slowdown mean", "TTFT mean", "TPOT mean", "wall (s)") if wide
            else ("backend", "mode", "FCT mean/p99", "slowdn", "TTFT", "TPOT", "wall s"))
    for c in cols:
        t.add_column(c, no_wrap=True, justify="left" if c in ("backend", "mode") else "right")
    for r in rows:
        fct = [_ms(r["fct_mean_s"]), _ms(r["fct_p99_s"])]
        rest = [f"{r['slowdown_mean']:.2f}", _ms(r["ttft_mean_s"], 1), _ms(r["tpot_mean_s"]), f"{r['wall_s']:.2f}"]
        t.add_row(r["backend"], r["mode"], *(fct if wide else ["/".join(fct)]), *rest)
    return t
