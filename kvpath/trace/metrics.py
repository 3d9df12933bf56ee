"""One summary of a trace's metrics: FCT, slowdown, TTFT and TPOT, as every report of a
run (the serving simulation's rows, sweeps, ``kvpath bridge report``) states them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvpath.trace.records import Trace

__all__ = ["TraceMetrics", "mean_p99"]


def mean_p99(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and 99th percentile (numpy's linear interpolation); (None, None) when empty."""
    v = np.asarray(values, dtype=float)
    return (float(v.mean()), float(np.percentile(v, 99))) if v.size else (None, None)


@dataclass(frozen=True)
class TraceMetrics:
    """Seconds throughout; None where the trace has nothing to measure.

    - FCT: every flow's ``end_s - start_s``;
    - slowdown: FCT / ``standalone_fct_s`` of each flow that has a non-zero one;
    - TTFT and TPOT: the requests that have one (a failed request has none; TPOT needs
      two output tokens).
    """

    requests: int
    flows: int
    fct_mean_s: float | None
    fct_p99_s: float | None
    slowdown_mean: float | None
    ttft_mean_s: float | None
    ttft_p99_s: float | None
    tpot_mean_s: float | None

    @classmethod
    def of(cls, trace: Trace) -> TraceMetrics:
        fct = mean_p99([f.fct_s for f in trace.flows])
        slowdown = mean_p99([f.fct_s / f.standalone_fct_s for f in trace.flows if f.standalone_fct_s])
        ttft = mean_p99([q.ttft_s for q in trace.requests if q.ttft_s is not None])
        tpot = mean_p99([q.tpot_s for q in trace.requests if q.tpot_s is not None])
        return cls(requests=len(trace.requests), flows=len(trace.flows), fct_mean_s=fct[0], fct_p99_s=fct[1],
                   slowdown_mean=slowdown[0], ttft_mean_s=ttft[0], ttft_p99_s=ttft[1], tpot_mean_s=tpot[0])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
