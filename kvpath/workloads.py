"""Workloads: who asks for what, when. The common types (``Request``, ``Workload``), the
synthetic shapes, and ``load_workload``, which picks a generator or a file reader
(``kvpath/workload_importers.py``).

- ``zipf``: the published P/D study's shape: prompt lengths Zipf(a) over the integers
  of [min_prompt, max_prompt] (a = 1.1, P(min + k) proportional to (k + 1)^-a), Poisson
  arrivals at ``qps``, output tokens = max(1, round(prompt / pd_ratio)) (pd_ratio 20).
- ``poisson``: Poisson arrivals; prompt and output lengths uniform in their ranges
  (fixed when a range's min equals its max).
- a file: a public trace (Azure, BurstGPT, Mooncake) or a ``Workload.to_jsonl`` file,
  read by ``kvpath.workload_importers.load_file``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["GENERATORS", "WorkloadError", "Request", "Workload", "sample_index", "zipf_lengths", "poisson_arrivals",
           "zipf", "poisson", "load_workload"]

GENERATORS = ("zipf", "poisson")


class WorkloadError(ValueError):
    pass


class Request(msgspec.Struct, frozen=True):
    request_id: str
    arrival_s: float  # seconds from the workload's start
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise WorkloadError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise WorkloadError(f"request {self.request_id}: prompt_tokens and output_tokens must be >= 1, "
                                f"got {self.prompt_tokens} and {self.output_tokens}")


def sample_index(total: int, n: int, seed: int) -> np.ndarray:
    """``n`` distinct positions of ``total`` in increasing order (deterministic in seed)."""
    if n < 0:
        raise WorkloadError(f"sample size must be >= 0, got {n}")
    if n >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))


def _summary(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "min": float(x.min()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(x.max())}


@dataclass
class Workload:
    """Requests in arrival order (ties keep their given order), a name and free-form meta.
    The methods return new workloads; none changes this one."""

    requests: list[Request]
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests = sorted(self.requests, key=lambda r: r.arrival_s)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def _derive(self, requests: list[Request], **meta: Any) -> Workload:
        return Workload(requests, self.name, {**self.meta, **meta})

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def mean_qps(self) -> float | None:
        """Arrivals per second between the first and the last; None when undefined
        (fewer than two requests, or all at one instant)."""
        d = self.duration_s
        return (len(self.requests) - 1) / d if len(self.requests) > 1 and d > 0 else None

    def scale_time(self, factor: float) -> Workload:
        """Every arrival (so every inter-arrival time) multiplied by ``factor``."""
        if not factor > 0 or not math.isfinite(factor):
            raise WorkloadError(f"time scale factor must be a finite number > 0, got {factor}")
        return self._derive([Request(r.request_id, r.arrival_s * factor, r.prompt_tokens, r.output_tokens)
                             for r in self.requests])

    def sample(self, n: int, seed: int = 0) -> Workload:
        """``n`` requests chosen at random (deterministic in seed), arrival order kept;
        all of them when n >= len(self)."""
        return self._derive([self.requests[i] for i in sample_index(len(self.requests), n, seed)])

    def limit_tokens(self, max_prompt: int | None = None, max_output: int | None = None) -> Workload:
        """Prompt and output lengths clipped to the limits (None: no limit)."""
        for name, v in (("max_prompt", max_prompt), ("max_output", max_output)):
            if v is not None and v < 1:
                raise WorkloadError(f"{name} must be >= 1, got {v}")
        mp, mo = max_prompt or math.inf, max_output or math.inf
        return self._derive([Request(r.request_id, r.arrival_s, int(min(r.prompt_tokens, mp)),
                                     int(min(r.output_tokens, mo))) for r in self.requests])

    def rate_qps(self, qps: float) -> Workload:
        """Arrivals rescaled (``scale_time``) so that ``mean_qps`` is ``qps``; a workload of
        fewer than two requests is returned as it is."""
        if not qps > 0 or not math.isfinite(qps):
            raise WorkloadError(f"qps must be a finite number > 0, got {qps}")
        if len(self.requests) < 2:
            return self._derive(list(self.requests))
        cur = self.mean_qps
        if cur is None:
            raise WorkloadError(f"workload {self.name!r}: all {len(self)} requests arrive at one instant; "
                                "it has no rate to rescale")
        return self.scale_time(cur / qps)

    def stats(self) -> dict[str, Any]:
        """count, duration_s, mean_qps and mean/min/p50/p90/p99/max of the token counts."""
        p = np.array([r.prompt_tokens for r in self.requests], dtype=float)
        o = np.array([r.output_tokens for r in self.requests], dtype=float)
        return {"name": self.name, "count": len(self.requests), "duration_s": self.duration_s,
                "mean_qps": self.mean_qps, "prompt_tokens": _summary(p), "output_tokens": _summary(o)}

    # ---- this module's own file format: one Request per JSON line --------------------
    def to_jsonl(self, path: str | Path) -> None:
        enc = msgspec.json.Encoder()
        with open(path, "wb") as f:
            for r in self.requests:
                f.write(enc.encode(r) + b"\n")

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        """A ``to_jsonl`` file back, arrivals as written (``workload_importers.load_kvpath``)."""
        from kvpath.workload_importers import load_kvpath

        return load_kvpath(path)


# ---- generators -----------------------------------------------------------------------
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


def load_workload(spec: str, n: int | None = None, qps: float | None = None, seed: int = 0, *,
                  min_prompt: int = 1024, max_prompt: int = 4096, a: float = 1.1, pd_ratio: float = 20.0,
                  min_output: int = 16, max_output: int = 256, format: str = "auto", model: str | None = None,
                  log_type: str | None = None, time_scale: float = 1.0, clip_prompt: int | None = None,
                  clip_output: int | None = None) -> Workload:
    """``zipf`` or ``poisson`` (``n`` requests at ``qps``; both required), or a workload file
    (``load_file``: sampled to ``n``, time-scaled, then rescaled to ``qps`` when given).
    Token counts are finally clipped to ``clip_prompt``/``clip_output``."""
    if spec in GENERATORS:
        if n is None or qps is None:
            raise WorkloadError(f"the {spec} workload needs a number of requests and a qps")
        if spec == "zipf":
            w = zipf(n, qps, seed, min_prompt, max_prompt, a=a, pd_ratio=pd_ratio)
        else:
            w = poisson(n, qps, seed, min_prompt, max_prompt, min_output, max_output)
        w = w.scale_time(time_scale) if time_scale != 1.0 else w
    elif Path(spec).exists():
        from kvpath.workload_importers import load_file  # the readers import this module's types

        w = load_file(spec, format, n=n, seed=seed, time_scale=time_scale, model=model, log_type=log_type)
        w = w.rate_qps(qps) if qps is not None else w
    else:
        raise WorkloadError(f"workload {spec!r} is neither {' nor '.join(GENERATORS)} nor an existing file")
    if clip_prompt is not None or clip_output is not None:
        w = w.limit_tokens(clip_prompt, clip_output)
    st = w.stats()
    logger.info("workload %s: %d requests over %.1f s (mean %s QPS), prompt p50 %s tokens",
                w.name, st["count"], st["duration_s"],
                f"{st['mean_qps']:.2f}" if st["mean_qps"] else "-", st["prompt_tokens"].get("p50", "-"))
    return w
