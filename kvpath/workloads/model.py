"""The workloads' types: ``Request``, ``Workload`` (with its own JSON-lines file format)
and ``WorkloadError``; the text-file helpers every reader shares."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

import msgspec
import numpy as np


__all__ = ["WorkloadError", "Request", "Workload", "sample_index"]


class WorkloadError(ValueError):
    pass


def open_text(p: Path) -> IO[str]:
    try:
        # utf-8-sig: CSVs saved by spreadsheet tools start with a BOM
        return open(p, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {p}: {e.strerror or e}") from None


def json_lines(p: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object) of each non-blank line."""
    line_no = 0
    with open_text(p) as f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{p}: line {line_no}, column {e.colno}: invalid JSON: {e.msg}") from None
                if not isinstance(d, dict):
                    raise WorkloadError(f"{p}: line {line_no}: expected a JSON object, got {type(d).__name__}")
                yield line_no, d
        except UnicodeDecodeError:
            raise WorkloadError(f"{p}: line {line_no + 1}: not UTF-8 text") from None


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
        """A ``to_jsonl`` file back: one Request per JSON line, arrivals kept as written."""
        p = Path(path)
        reqs = []
        for line_no, d in json_lines(p):
            try:
                reqs.append(msgspec.convert(d, Request))
            except (msgspec.ValidationError, WorkloadError) as e:
                raise WorkloadError(f"{p}: line {line_no}: {e}") from None
        return cls(reqs, f"kvpath:{p.name}", {"format": "kvpath", "source": str(p)})
