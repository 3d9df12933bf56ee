"""Repeated runs: the order they run in, where each one's files go, and the median and
min..max of a measurement over a variant's repeats. Pure functions, no I/O.

Why interleave: a run that shares the machine with something else, or pays the cold
start, should not always be the same variant's. With repeats rotated (A B C, then
B C A, then C A B) every variant takes every position once in every ``len(labels)``
repeats, so a disturbance lands on different variants and shows up as spread.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


def rotation(items: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """(repeat number from 1, item) in running order: repeat r runs the items rotated by
    r - 1 places."""
    n = len(items)
    return [(r + 1, items[(r + k) % n]) for r in range(repeats) for k in range(n)] if n else []


def folder_of(label: str) -> str:
    """A variant's folder: its label, a placement or push order joined by "-", not "/"
    (``cc/joint/srpt1`` -> ``cc-joint-srpt1``)."""
    return label.replace("/", "-")


def run_dir(out: str | Path, label: str, repeat: int, repeats: int) -> Path:
    """``<out>/<label>`` for a single run (the layout before repeats existed, which the
    docs and tests keep), ``<out>/<label>/r<k>`` for each of several (``folder_of``)."""
    base = Path(out) / folder_of(label)
    return base if repeats == 1 else base / f"r{repeat}"


@dataclass(frozen=True)
class Spread:
    """A value over a variant's repeats: median and min..max over ``n`` runs (the valid
    ones when there are any), of ``runs`` in all, ``valid`` of them valid."""

    median: float | None
    lo: float | None
    hi: float | None
    n: int
    runs: int
    valid: int

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n, "runs": self.runs,
                "valid": self.valid}


def spread(values: Sequence[float | None], valid: Sequence[bool]) -> Spread:
    """Median and min..max over the valid runs' values; over every run's when none is
    valid (then ``valid`` is 0 and whoever prints it must say so). Missing values
    (None) are left out."""
    keep = [v for v, ok in zip(values, valid) if ok] if any(valid) else list(values)
    xs = [float(v) for v in keep if v is not None]
    if not xs:
        return Spread(None, None, None, 0, len(values), sum(valid))
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs), len(values), sum(valid))


def valid_count(runs: int, valid: int) -> str:
    """"3/5 valid", or for a single run its verdict alone."""
    if runs == 1:
        return "valid" if valid else "INVALID"
    return f"{valid}/{runs} valid"


# the measurements a testbed run's table and summary.json aggregate: name -> getter
def _get(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    def get(s: dict[str, Any]) -> float | None:
        v: Any = s
        for k in keys:
            if not isinstance(v, dict) or k not in v:
                return None
            v = v[k]
        return v

    return get


def summary_fields(unit: str) -> dict[str, Callable[[dict[str, Any]], float | None]]:
    """The aggregated fields of a run's summary in ``unit`` (testbed or datacenter)."""
    return {"fct_mean_s": _get(unit, "fct_s", "mean"), "fct_p99_s": _get(unit, "fct_s", "p99"),
            "slowdown_p50": _get(unit, "slowdown", "p50"), "slowdown_p99": _get(unit, "slowdown", "p99"),
            "ttft_mean_s": _get(unit, "ttft_s", "mean"), "ttft_p99_s": _get(unit, "ttft_s", "p99"),
            "tpot_mean_s": _get(unit, "tpot_s", "mean"), "path_agreement": _get("path_agreement"),
            "push_overhead_s": _get("push_overhead_s"), "cpu_idle_median": _get("fidelity", "cpu_idle_median"),
            "ok": _get("ok")}


def aggregate(summaries: Sequence[dict[str, Any]], unit: str) -> dict[str, Spread]:
    """One mode's repeats' summaries -> field -> Spread (over the valid repeats)."""
    valid = [bool(s["fidelity"]["valid"]) for s in summaries]
    return {name: spread([get(s) for s in summaries], valid) for name, get in summary_fields(unit).items()}
