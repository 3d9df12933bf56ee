"""The synthetic workloads.

- ``zipf``: the published P/D study's shape: prompt lengths Zipf(a) over the integers
  of [min_prompt, max_prompt] (a = 1.1, P(min + k) proportional to (k + 1)^-a), Poisson
  arrivals at ``qps``, output tokens = max(1, round(prompt / pd_ratio)) (pd_ratio 20).
- ``poisson``: Poisson arrivals; prompt and output lengths uniform in their ranges
  (fixed when a range's min equals its max).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from kvpath.workloads.model import Request, Workload, WorkloadError

GENERATORS = ("zipf", "poisson")


def _check_gen(n: int, qps: float, pairs: Sequence[tuple[str, int, int]]) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise WorkloadError(f"number of requests must be an integer >= 0, got {n!r}")
    if not qps > 0 or not math.isfinite(qps):
        raise WorkloadError(f"qps must be a finite number > 0, got {qps}")
    for what, lo, hi in pairs:
        if not 1 <= lo <= hi:
            raise WorkloadError(f"{what} range must satisfy 1 <= min <= max, got [{lo}, {hi}]")


def zipf_lengths(rng: np.random.Generator, n: int, a: float, lo: int, hi: int) -> np.ndarray:
    """Bounded Zipf(a) over the integers lo..hi: P(lo + k) proportional to (k + 1)^-a.
    Inverse CDF (the same draws as ``rng.choice(..., p=...)``), so it is exact for any a > 0."""
    if not 1 <= lo <= hi:
        raise WorkloadError(f"prompt range must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    if not a > 0:
        raise WorkloadError(f"Zipf exponent must be > 0, got {a}")
    w = np.arange(1, hi - lo + 2, dtype=float) ** -a
    cdf = np.cumsum(w / w.sum())
    cdf /= cdf[-1]
    idx = np.searchsorted(cdf, rng.random(n), side="right")
    return lo + np.minimum(idx, cdf.size - 1)


def poisson_arrivals(rng: np.random.Generator, n: int, qps: float) -> np.ndarray:
    """Arrival times of a Poisson process at ``qps``: cumulated exponential gaps."""
    return np.cumsum(rng.exponential(1.0 / qps, size=n))


def _generated(name: str, arr: np.ndarray, prompts: np.ndarray, outs: np.ndarray, meta: dict[str, Any]) -> Workload:
    reqs = [Request(f"r{i}", float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(arr, prompts, outs))]
    return Workload(reqs, name, {"format": name, **meta})


def zipf(n: int, qps: float, seed: int = 0, min_prompt: int = 1024, max_prompt: int = 4096, a: float = 1.1,
         pd_ratio: float = 20.0) -> Workload:
    """The P/D study's workload: Zipf(a) prompts, Poisson arrivals, outputs = prompt / pd_ratio."""
    _check_gen(n, qps, [("prompt", min_prompt, max_prompt)])
    if not pd_ratio > 0:
        raise WorkloadError(f"pd_ratio must be > 0, got {pd_ratio}")
    rng = np.random.default_rng(seed)
    prompts = zipf_lengths(rng, n, a, min_prompt, max_prompt)
    arr = poisson_arrivals(rng, n, qps)
    outs = np.maximum(1, np.round(prompts / pd_ratio)).astype(np.int64)  # round half to even, as round()
    return _generated("zipf", arr, prompts, outs, {"a": a, "pd_ratio": pd_ratio, "qps": qps, "seed": seed,
                                                   "min_prompt": min_prompt, "max_prompt": max_prompt})


def poisson(n: int, qps: float, seed: int = 0, min_prompt: int = 1024, max_prompt: int = 4096,
            min_output: int = 16, max_output: int = 256) -> Workload:
    """Poisson arrivals; lengths uniform over [min, max] (both ends included)."""
    _check_gen(n, qps, [("prompt", min_prompt, max_prompt), ("output", min_output, max_output)])
    rng = np.random.default_rng(seed)
    arr = poisson_arrivals(rng, n, qps)
    prompts = rng.integers(min_prompt, max_prompt + 1, size=n)
    outs = rng.integers(min_output, max_output + 1, size=n)
    return _generated("poisson", arr, prompts, outs, {"qps": qps, "seed": seed})
