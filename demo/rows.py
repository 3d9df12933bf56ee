"""The demo's table: measured and simulated FCT, TTFT and TPOT per variant, and the
simulated-vs-measured error, raw and after calibration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from rich.table import Table

from kvpath.trace_metrics import TraceMetrics, mean_p99

QUANTITIES = ("fct", "ttft", "tpot")


@dataclass
class Row:
    """One line of the table. Values in seconds of datacenter-equivalent time; ``errors``:
    per quantity, (simulated / measured - 1) of the mean and of the p99."""

    variant: str
    source: str  # measured, flow, flow calibrated, ns3, ...
    values: dict[str, tuple[float | None, float | None]]  # quantity -> (mean, p99)
    errors: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    note: str = ""  # the fidelity verdict of a measured row: valid, INVALID, or n failed


def _pair(a: np.ndarray, scale: float) -> tuple[float | None, float | None]:
    m, p = mean_p99(a[np.isfinite(a)])
    return (None if m is None else m / scale, None if p is None else p / scale)


def _err(meas: np.ndarray, sim: np.ndarray) -> tuple[float, float] | None:
    """(mean, p99) relative errors; None where ``Errors.of_finite`` has none."""
    from kvpath.bridge.compare import Errors  # the bridge loads on first use, as in demo/steps.py

    e = Errors.of_finite(meas, sim)
    return None if e is None else (e.mean, e.p99)


def replay_rows(variant: str, replays: Sequence[tuple[str, object]], scale: float, note: str) -> list[Row]:
    """The measured row and one simulated row per (source, ``compare.Replayed``); ``scale``:
    testbed seconds per datacenter second (B/S)."""
    first = replays[0][1]
    measured = {q: getattr(first, q) for q in QUANTITIES}
    rows = [Row(variant, "measured", {q: (None, None) if v is None else _pair(v[0], scale)
                                      for q, v in measured.items()}, note=note)]
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


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(e: tuple[float, float] | None) -> str:
    return "-" if e is None else f"{e[0]:+.0%}/{e[1]:+.0%}"


def table(rows: Sequence[Row], title: str) -> Table:
    t = Table(title=title)
    for c in ("variant", "source", "FCT mean", "FCT p99", "TTFT mean", "TTFT p99", "TPOT", "FCT err",
              "TTFT err", "TPOT err", "fidelity"):
        t.add_column(c, justify="left" if c in ("variant", "source", "fidelity") else "right", no_wrap=True)
    last = None
    for r in rows:
        if last is not None and r.variant != last:
            t.add_section()
        last = r.variant
        tp = r.errors.get("tpot")
        t.add_row(r.variant, r.source, _ms(r.values["fct"][0]), _ms(r.values["fct"][1]), _ms(r.values["ttft"][0]),
                  _ms(r.values["ttft"][1]), _ms(r.values["tpot"][0]), _pct(r.errors.get("fct")),
                  _pct(r.errors.get("ttft")), "-" if tp is None else f"{tp[0]:+.0%}", r.note)
    return t


def to_dicts(rows: Sequence[Row]) -> list[dict[str, object]]:
    """The rows as JSON-ready dicts (``demo.json``)."""
    return [{"variant": r.variant, "source": r.source, "values_s": {q: list(v) for q, v in r.values.items()},
             "errors": {q: None if e is None else list(e) for q, e in r.errors.items()}, "note": r.note}
            for r in rows]
