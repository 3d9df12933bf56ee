"""The demo's table: measured and simulated FCT, TTFT and TPOT per variant, and the
simulated-vs-measured error, raw and after calibration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from rich.table import Table

from kvpath.testbed.repeats import spread, valid_count
from kvpath.testbed.run_table import num
from kvpath.trace.metrics import TraceMetrics, mean_p99

QUANTITIES = ("fct", "ttft", "tpot")


@dataclass
class Row:
    """One line of the table. Values in seconds of datacenter-equivalent time; ``errors``:
    per quantity, (simulated / measured - 1) of the mean and of the p99."""

    variant: str
    source: str  # measured, flow, flow calibrated, ns3, ...
    values: dict[str, tuple[float | None, float | None]]  # quantity -> (mean, p99)
    errors: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    note: str = ""  # the fidelity verdict of a measured row: valid, INVALID, "2/3 valid", n failed
    runs: int = 1  # repeats this row is the median of
    valid: int = 1  # of them valid
    # quantity -> ((min, max) of the mean, (min, max) of the p99) over the repeats combined
    ranges: dict[str, tuple[tuple[float | None, float | None], ...]] = field(default_factory=dict)
    failed: int = 0  # requests failed (measured rows), over every repeat


def _pair(a: np.ndarray, scale: float) -> tuple[float | None, float | None]:
    m, p = mean_p99(a[np.isfinite(a)])
    return (None if m is None else m / scale, None if p is None else p / scale)


def _err(meas: np.ndarray, sim: np.ndarray) -> tuple[float, float] | None:
    """(mean, p99) relative errors; None where ``Errors.of_finite`` has none."""
    from kvpath.bridge.compare import Errors  # the bridge loads on first use, as in demo/steps.py

    e = Errors.of_finite(meas, sim)
    return None if e is None else (e.mean, e.p99)


def replay_rows(variant: str, replays: Sequence[tuple[str, object]], scale: float, note: str,
                failed: int = 0) -> list[Row]:
    """The measured row and one simulated row per (source, ``compare.Replayed``); ``scale``:
    testbed seconds per datacenter second (B/S)."""
    first = replays[0][1]
    measured = {q: getattr(first, q) for q in QUANTITIES}
    rows = [Row(variant, "measured", {q: (None, None) if v is None else _pair(v[0], scale)
                                      for q, v in measured.items()}, note=note, failed=failed)]
    for source, r in replays:
        values, errors = {}, {}
        for q in QUANTITIES:
            v = getattr(r, q)
            values[q] = (None, None) if v is None else _pair(v[1], scale)
            errors[q] = None if v is None else _err(v[0], v[1])
        rows.append(Row(variant, source, values, errors))
    return rows


def simulated_rows(variant: str, source: str, metrics: TraceMetrics) -> Row:
    """A row of a simulation alone (no measurement to compare with)."""
    return Row(variant, source, {"fct": (metrics.fct_mean_s, metrics.fct_p99_s),
                                 "ttft": (metrics.ttft_mean_s, metrics.ttft_p99_s),
                                 "tpot": (metrics.tpot_mean_s, None)})


def combine(runs: Sequence[Sequence[Row]], valid: Sequence[bool]) -> list[Row]:
    """One row per (variant, source) over a variant's repeats: each value the median of
    the valid repeats' (of every repeat's when none is valid), with min..max in
    ``ranges``; ``runs`` and ``valid`` count the repeats. ``runs``: per repeat, its rows."""
    if len(runs) == 1:
        return [dataclasses.replace(r, valid=int(valid[0])) for r in runs[0]]
    out = []
    for first in runs[0]:
        # a replay that failed in one repeat leaves its source out there: match by source
        pairs = [(r, valid[i]) for i, rs in enumerate(runs) for r in rs if r.source == first.source]
        same, ok = [r for r, _ in pairs], [v for _, v in pairs]
        values, ranges, errors = {}, {}, {}
        for q in QUANTITIES:
            m, p = (spread([r.values[q][j] for r in same], ok) for j in (0, 1))
            values[q], ranges[q] = (m.median, p.median), ((m.lo, m.hi), (p.lo, p.hi))
            errs = [r.errors.get(q) for r in same]
            em, ep = (spread([None if e is None else e[j] for e in errs], ok) for j in (0, 1))
            errors[q] = None if em.median is None else (em.median, ep.median)
        failed = sum(r.failed for r in same)
        note = "" if first.source != "measured" else valid_count(len(same), sum(ok))
        note += f", {failed} failed" if note and failed else ""
        out.append(Row(first.variant, first.source, values, errors if first.errors else {}, note,
                       runs=len(same), valid=sum(ok), ranges=ranges, failed=failed))
    return out


def _ms(v: float | None) -> str:
    return num(v)


def _pct(e: tuple[float, float] | None) -> str:
    return "-" if e is None else f"{e[0]:+.0%}/{e[1]:+.0%}"


def _ranged_ms(r: Row, q: str, j: int) -> str:
    v = r.values[q][j]
    lo, hi = r.ranges[q][j] if q in r.ranges else (None, None)
    if r.runs <= 1 or lo is None or lo == hi:
        return _ms(v)
    return f"{_ms(v)} ({_ms(lo)}..{_ms(hi)})"


def _short_verdict(r: Row) -> str:
    """The fidelity cell of the narrow view: a word or "2/3 valid"; the reasons go to
    the notes."""
    if r.source != "measured":
        return ""
    word = valid_count(r.runs, r.valid)
    if r.failed:
        word = "failed" if r.runs == 1 else word + "!"
    return word if r.valid == r.runs and not r.failed else f"[red]{word}[/red]"


NARROW = ("variant", "source", "FCT mean/p99", "TTFT mean/p99", "TPOT", "fidelity")
WIDE = ("variant", "source", "runs", "FCT mean", "FCT p99", "TTFT mean", "TTFT p99", "TPOT", "FCT err", "TTFT err",
        "TPOT err", "fidelity")


def _narrow_cells(r: Row) -> list[str]:
    """A row with a measurement to compare with: its errors; otherwise its values."""
    if r.errors:
        tp = r.errors.get("tpot")
        cells = [_pct(r.errors.get("fct")), _pct(r.errors.get("ttft")), "-" if tp is None else f"{tp[0]:+.0%}"]
    else:
        cells = [f"{_ms(r.values[q][0])}/{_ms(r.values[q][1])}" for q in ("fct", "ttft")] + [_ms(r.values["tpot"][0])]
    return [r.variant, r.source, *cells, _short_verdict(r)]


def _wide_cells(r: Row) -> list[str]:
    tp = r.errors.get("tpot")
    return [r.variant, r.source, str(r.runs),
            *(_ranged_ms(r, q, j) for q, j in (("fct", 0), ("fct", 1), ("ttft", 0), ("ttft", 1), ("tpot", 0))),
            _pct(r.errors.get("fct")), _pct(r.errors.get("ttft")), "-" if tp is None else f"{tp[0]:+.0%}", r.note]


def table(rows: Sequence[Row], title: str, wide: bool = False) -> Table:
    """The demo's table. Narrow (fits 80 columns): a measured row gives its values in ms,
    a simulated row its error against the measurement (a row with nothing to compare
    with, its values); the wide view has every value, error and min..max."""
    t = Table(title=title)
    for c in WIDE if wide else NARROW:
        t.add_column(c, justify="left" if c in ("variant", "source", "fidelity") else "right", no_wrap=True)
    last = None
    for r in rows:
        if last is not None and r.variant != last:
            t.add_section()
        last = r.variant
        t.add_row(*(_wide_cells(r) if wide else _narrow_cells(r)))
    return t


def range_notes(rows: Sequence[Row]) -> list[str]:
    """What the narrow view leaves out of a measured row over several repeats: min..max."""
    out = []
    for r in rows:
        if r.source != "measured" or r.runs <= 1:
            continue
        over = f"the {r.valid} valid" if r.valid else f"all {r.runs} (none valid)"
        out.append(f"{r.variant}: measured over {over} of {r.runs} runs, min..max: FCT mean "
                   f"{_ranged_ms(r, 'fct', 0)}, p99 {_ranged_ms(r, 'fct', 1)}; TTFT mean {_ranged_ms(r, 'ttft', 0)}, "
                   f"p99 {_ranged_ms(r, 'ttft', 1)}; TPOT {_ranged_ms(r, 'tpot', 0)}")
    return out


def to_dicts(rows: Sequence[Row]) -> list[dict[str, object]]:
    """The rows as JSON-ready dicts (``demo.json``)."""
    return [{"variant": r.variant, "source": r.source, "values_s": {q: list(v) for q, v in r.values.items()},
             "errors": {q: None if e is None else list(e) for q, e in r.errors.items()}, "note": r.note,
             "runs": r.runs, "valid_runs": r.valid,
             "ranges_s": {q: [list(x) for x in v] for q, v in r.ranges.items()}}
            for r in rows]
