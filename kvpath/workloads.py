"""Workloads: who asks for what, when. Synthetic shapes and importers of public traces.

- ``zipf``: the published P/D study's shape: prompt lengths Zipf(a) over the integers
  of [min_prompt, max_prompt] (a = 1.1), Poisson arrivals at ``qps``, output tokens =
  prompt / ``pd_ratio`` (20).
- ``poisson``: Poisson arrivals, prompt and output lengths uniform in their ranges.
- Files: the Azure LLM inference traces (2023, 2024: ``TIMESTAMP, ContextTokens,
  GeneratedTokens``), BurstGPT (``Timestamp, Model, Request tokens, Response tokens,
  ...``) and Mooncake (jsonl: ``timestamp`` ms, ``input_length``, ``output_length``),
  detected by their header; arrivals are made relative to the first request, then
  optionally sampled (``n``) and rescaled to ``qps``.
Nothing is downloaded.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class Workload:
    requests: list[Request]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests.sort(key=lambda r: r.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if len(self.requests) > 1 else 0.0

    def sample(self, n: int, seed: int = 0) -> "Workload":
        """``n`` requests chosen at random (deterministic), arrival order kept."""
        if n >= len(self.requests):
            return self
        idx = np.sort(np.random.default_rng(seed).choice(len(self.requests), size=n, replace=False))
        return Workload([self.requests[i] for i in idx], self.source, dict(self.meta))

    def scale_time(self, factor: float) -> "Workload":
        if factor <= 0:
            raise WorkloadError("time scale factor must be > 0")
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return Workload([Request(r.request_id, (r.arrival_s - t0) * factor, r.prompt_tokens, r.output_tokens)
                         for r in self.requests], self.source, dict(self.meta))

    def rate_qps(self, qps: float) -> "Workload":
        """Rescale arrivals so the mean rate is ``qps``."""
        if qps <= 0:
            raise WorkloadError("qps must be > 0")
        if len(self.requests) < 2 or self.duration_s == 0:
            return self
        return self.scale_time((len(self.requests) - 1) / qps / self.duration_s)

    def to_jsonl(self, path: str | Path) -> None:
        Path(path).write_text("".join(json.dumps(r.__dict__) + "\n" for r in self.requests))


def zipf_lengths(rng: np.random.Generator, n: int, a: float, lo: int, hi: int) -> np.ndarray:
    """Zipf(a) over the integers lo..hi: P(k) proportional to (k - lo + 1)^-a."""
    if not 1 <= lo <= hi:
        raise WorkloadError(f"prompt range must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    ranks = np.arange(1, hi - lo + 2, dtype=float)
    p = ranks ** -a
    return lo + rng.choice(ranks.size, size=n, p=p / p.sum())


def _poisson_arrivals(rng: np.random.Generator, n: int, qps: float) -> np.ndarray:
    if qps <= 0:
        raise WorkloadError("qps must be > 0")
    return np.cumsum(rng.exponential(1.0 / qps, size=n)) - 0.0


def zipf(n: int, qps: float, seed: int = 0, min_prompt: int = 1024, max_prompt: int = 4096, a: float = 1.1,
         pd_ratio: float = 20.0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = zipf_lengths(rng, n, a, min_prompt, max_prompt)
    arr = _poisson_arrivals(rng, n, qps)
    outs = np.maximum(1, np.round(prompts / pd_ratio)).astype(int)
    return Workload([Request(f"r{i}", float(arr[i]), int(prompts[i]), int(outs[i])) for i in range(n)], "zipf",
                    {"a": a, "pd_ratio": pd_ratio, "qps": qps, "seed": seed})


def poisson(n: int, qps: float, seed: int = 0, min_prompt: int = 1024, max_prompt: int = 4096,
            min_output: int = 16, max_output: int = 256) -> Workload:
    rng = np.random.default_rng(seed)
    arr = _poisson_arrivals(rng, n, qps)
    prompts = rng.integers(min_prompt, max_prompt + 1, size=n)
    outs = rng.integers(min_output, max_output + 1, size=n)
    return Workload([Request(f"r{i}", float(arr[i]), int(prompts[i]), int(outs[i])) for i in range(n)], "poisson",
                    {"qps": qps, "seed": seed})


# -- importers ---------------------------------------------------------------------------
def _norm(h: str) -> str:
    return h.strip().lower().replace(" ", "_")


def _azure_time(s: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than datetime parses
    s = s.strip()
    if "." in s:
        head, frac = s.split(".", 1)
        frac = (frac + "000000")[:6]
        s = f"{head}.{frac}"
    return datetime.fromisoformat(s).timestamp()


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise WorkloadError(f"{path}: empty file")
    return [_norm(h) for h in rows[0]], rows[1:]


def _col(header: list[str], path: Path, *names: str) -> int:
    for n in names:
        if n in header:
            return header.index(n)
    raise WorkloadError(f"{path}: no column {names[0]!r} in the header ({', '.join(header)})")


def load_file(path: str | Path, fmt: str = "auto", model: str | None = None) -> Workload:
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"workload file {p} does not exist")
    if fmt == "auto":
        first = p.read_text(errors="replace").split("\n", 1)[0]
        if first.lstrip().startswith("{"):
            fmt = "mooncake"
        else:
            h = [_norm(x) for x in first.split(",")]
            fmt = "azure" if "contexttokens" in h else "burstgpt" if "request_tokens" in h else ""
        if not fmt:
            raise WorkloadError(f"{p}: unknown format (header {first[:120]!r}); pass format=azure|burstgpt|mooncake")
    reqs: list[Request] = []
    if fmt == "mooncake":
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                reqs.append(Request(f"r{len(reqs)}", float(d["timestamp"]) / 1000.0, int(d["input_length"]),
                                    max(1, int(d["output_length"]))))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise WorkloadError(f"{p}: line {i}: {type(e).__name__}: {e}") from None
    elif fmt in ("azure", "burstgpt"):
        header, rows = _read_csv(p)
        if fmt == "azure":
            ct, cp, co = (_col(header, p, "timestamp"), _col(header, p, "contexttokens"),
                          _col(header, p, "generatedtokens"))
            cm = None
        else:
            ct, cp, co = (_col(header, p, "timestamp"), _col(header, p, "request_tokens"),
                          _col(header, p, "response_tokens"))
            cm = header.index("model") if "model" in header else None
        dropped = 0
        for i, row in enumerate(rows, 2):
            if not row:
                continue
            try:
                t = _azure_time(row[ct]) if fmt == "azure" else float(row[ct])
                pt, ot = int(float(row[cp])), int(float(row[co]))
            except (ValueError, IndexError) as e:
                raise WorkloadError(f"{p}: line {i}: {e}") from None
            if cm is not None and model and row[cm].strip() != model:
                continue
            if ot <= 0 or pt <= 0:
                dropped += 1  # BurstGPT logs failed requests with 0 response tokens
                continue
            reqs.append(Request(f"r{len(reqs)}", t, pt, ot))
        if dropped:
            logger.info("%s: dropped %d rows with 0 tokens (failed requests)", p, dropped)
    else:
        raise WorkloadError(f"format must be azure, burstgpt or mooncake, got {fmt!r}")
    if not reqs:
        raise WorkloadError(f"{p}: no requests")
    return Workload(reqs, f"{fmt}:{p.name}").scale_time(1.0)


def load_workload(spec: str, n: int, qps: float | None = None, seed: int = 0, min_prompt: int = 1024,
                  max_prompt: int = 4096, pd_ratio: float = 20.0, fmt: str = "auto") -> Workload:
    """``zipf``, ``poisson`` or a trace file; ``n`` requests, at ``qps`` on average
    (a file keeps its own rate when qps is None)."""
    if spec == "zipf":
        return zipf(n, qps or 1.0, seed, min_prompt, max_prompt, pd_ratio=pd_ratio)
    if spec == "poisson":
        return poisson(n, qps or 1.0, seed, min_prompt, max_prompt)
    w = load_file(spec, fmt).sample(n, seed)
    return w.rate_qps(qps) if qps else w
