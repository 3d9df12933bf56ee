"""Workloads: who asks for what, when. Synthetic shapes and importers of public traces.

- ``zipf``: the published P/D study's shape: prompt lengths Zipf(a) over the integers
  of [min_prompt, max_prompt] (a = 1.1, P(min + k) proportional to (k + 1)^-a), Poisson
  arrivals at ``qps``, output tokens = max(1, round(prompt / pd_ratio)) (pd_ratio 20).
- ``poisson``: Poisson arrivals; prompt and output lengths uniform in their ranges
  (fixed when a range's min equals its max).
- Files (nothing is downloaded): the Azure LLM inference traces 2023 and 2024
  (``TIMESTAMP, ContextTokens, GeneratedTokens``), BurstGPT (``Timestamp, Model,
  Request tokens, Response tokens, ...``), Mooncake (jsonl: ``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids``) and this module's own jsonl
  (``Workload.to_jsonl``). The format is detected from the first line. Arrivals are made
  relative to the first request; then the trace is optionally sampled and time-scaled.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import logging
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

import msgspec
import numpy as np

logger = logging.getLogger(__name__)

FORMATS = ("azure", "burstgpt", "mooncake", "kvpath")
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


def _sample_index(total: int, n: int, seed: int) -> np.ndarray:
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
        return self._derive([self.requests[i] for i in _sample_index(len(self.requests), n, seed)])

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
        p = Path(path)
        reqs = []
        for line_no, d in _json_lines(p):
            try:
                reqs.append(msgspec.convert(d, Request))
            except (msgspec.ValidationError, WorkloadError) as e:
                raise WorkloadError(f"{p}: line {line_no}: {e}") from None
        return Workload(reqs, f"kvpath:{p.name}", {"format": "kvpath", "source": str(p)})


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


# ---- file readers ---------------------------------------------------------------------
def _norm(h: str) -> str:
    """Header names compare case-insensitively, spaces and underscores alike."""
    return " ".join(h.replace("_", " ").lower().split())


def _open(p: Path) -> IO[str]:
    try:
        # utf-8-sig: CSVs saved by spreadsheet tools start with a BOM
        return open(p, newline="", encoding="utf-8-sig")
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {p}: {e.strerror or e}") from None


def _json_lines(p: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object) of each non-blank line."""
    line_no = 0
    with _open(p) as f:
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


class _Csv:
    """A CSV file's wanted columns, found by header name; cell errors name file, line and column."""

    def __init__(self, p: Path, f: IO[str], names: Sequence[str], optional: Sequence[str] = ()) -> None:
        self.p = p
        self.reader = csv.reader(f)
        try:
            header = next(self.reader, None)
        except (csv.Error, UnicodeDecodeError) as e:
            raise WorkloadError(f"{p}: line 1: {e}") from None
        if not header:
            raise WorkloadError(f"{p}: line 1: empty file, expected a CSV header")
        self.header = [h.strip() for h in header]
        norm = [_norm(h) for h in header]
        missing = [n for n in names if n not in norm]
        if missing:
            raise WorkloadError(f"{p}: line 1: no column {missing[0]!r} in the header ({', '.join(self.header)})")
        self.idx = [norm.index(n) for n in names] + [norm.index(n) if n in norm else -1 for n in optional]
        self.need = max(self.idx) + 1

    def rows(self) -> Iterator[tuple[int, list[str | None]]]:
        """(line number, the wanted cells; None for an absent optional column)."""
        r = self.reader
        try:
            for row in r:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) < self.need:
                    raise WorkloadError(f"{self.p}: line {r.line_num}: {len(row)} column(s), "
                                        f"the header has {len(self.header)}")
                yield r.line_num, [row[i] if 0 <= i < len(row) else None for i in self.idx]
        except (csv.Error, UnicodeDecodeError) as e:
            raise WorkloadError(f"{self.p}: line {r.line_num + 1}: {e}") from None

    def parse(self, line: int, k: int, cell: str, conv: Callable[[str], Any], what: str) -> Any:
        try:
            return conv(cell)
        except (ValueError, OverflowError):
            col = self.idx[k]
            raise WorkloadError(f"{self.p}: line {line}, column {col + 1} ({self.header[col]}): "
                                f"cannot read {cell!r} as {what}") from None


def _tokens(s: str | int | float) -> int:
    v = float(s) if isinstance(s, str) else s
    if isinstance(v, bool) or not float(v).is_integer() or v < 0:
        raise ValueError(s)
    return int(v)


def _seconds(s: str | int | float) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(s)
    return v


_DATETIME = re.compile(r"(\d{4}-\d{1,2}-\d{1,2})[ T](\d{1,2}):(\d{2})(?::(\d{2})(?:[.,](\d+))?)?"
                       r"\s*(Z|[+-]\d{2}(?::?\d{2})?)?")
_EPOCH_ORDINAL = dt.date(1970, 1, 1).toordinal()


@lru_cache(maxsize=4096)
def _day_s(date: str) -> int:
    return (dt.date(*map(int, date.split("-"))).toordinal() - _EPOCH_ORDINAL) * 86400


def _datetime_split(s: str) -> tuple[int, float]:
    """(whole seconds since the Unix epoch, fraction): kept apart so differences keep all
    7 fractional digits (a float of ~1.7e9 s resolves only ~2e-7 s)."""
    s = s.strip()
    m = _DATETIME.fullmatch(s)
    if not m:
        v = _seconds(s)
        return math.floor(v), v - math.floor(v)
    date, hh, mm, ss, frac, tz = m.groups()
    h, mi, sec = int(hh), int(mm), int(ss or 0)
    if h > 23 or mi > 59 or sec > 60:
        raise ValueError(s)
    whole = _day_s(date) + h * 3600 + mi * 60 + sec
    if tz and tz != "Z":
        tz = tz.replace(":", "")
        off = int(tz[1:3]) * 3600 + (int(tz[3:5]) * 60 if len(tz) > 3 else 0)
        whole -= off if tz[0] == "+" else -off
    return whole, (int(frac) / 10 ** len(frac) if frac else 0.0)


def parse_datetime(s: str) -> float:
    """Seconds (Unix epoch) of ``YYYY-MM-DD HH:MM[:SS[.f]]`` (``T`` or a space between date
    and time) with any number of fractional digits (the Azure traces have 7, more than
    ``datetime`` reads) and an optional zone (``Z``, ``+HH:MM``); a time without zone is read
    as UTC, not local, so a DST change inside a trace shifts nothing. A plain number is
    taken as seconds."""
    whole, frac = _datetime_split(s)
    return whole + frac


def _imported(p: Path, fmt: str, rows: list[tuple[float, int, int]], meta: dict[str, Any], n: int | None,
              seed: int, time_scale: float) -> Workload:
    """Arrival order, ids by position in the whole trace, sampled, first arrival at 0, time-scaled."""
    if not rows:
        raise WorkloadError(f"{p}: no requests (after dropping and filtering rows: {meta})")
    t = np.array([r[0] for r in rows])
    order = np.argsort(t, kind="stable")
    ranks = _sample_index(len(rows), len(rows) if n is None else n, seed)  # positions in arrival order
    if ranks.size == 0:
        raise WorkloadError(f"{p}: sample size 0: no requests")
    keep = order[ranks]
    t0 = t[keep[0]]
    reqs = [Request(f"r{k}", float(t[i] - t0), rows[i][1], rows[i][2]) for k, i in zip(ranks, keep)]
    w = Workload(reqs, f"{fmt}:{p.name}", {"format": fmt, "source": str(p), "rows_kept": len(rows), **meta,
                                           "sampled": n, "time_scale": time_scale})
    return w.scale_time(time_scale) if time_scale != 1.0 else w


def _drop(pt: int, ot: int, dropped: dict[str, int]) -> bool:
    if ot == 0:
        dropped["zero_output"] += 1
    elif pt == 0:
        dropped["zero_prompt"] += 1
    else:
        return False
    return True


def load_azure(path: str | Path, *, n: int | None = None, seed: int = 0, time_scale: float = 1.0) -> Workload:
    """An Azure LLM inference trace (2023 or 2024): TIMESTAMP, ContextTokens, GeneratedTokens.
    Rows with 0 context or 0 generated tokens are dropped and counted (meta["dropped"])."""
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    dropped = {"zero_output": 0, "zero_prompt": 0}
    base: int | None = None
    with _open(p) as f:
        c = _Csv(p, f, ("timestamp", "contexttokens", "generatedtokens"))
        for line, (ts, cp, co) in c.rows():
            whole, frac = c.parse(line, 0, ts, _datetime_split, "a date-time")
            base = whole if base is None else base
            t = (whole - base) + frac
            pt = c.parse(line, 1, cp, _tokens, "a token count")
            ot = c.parse(line, 2, co, _tokens, "a token count")
            if not _drop(pt, ot, dropped):
                rows.append((t, pt, ot))
    if any(dropped.values()):
        logger.info("%s: dropped rows with 0 tokens: %s", p, dropped)
    return _imported(p, "azure", rows, {"dropped": dropped}, n, seed, time_scale)


def load_burstgpt(path: str | Path, *, model: str | None = None, log_type: str | None = None,
                  n: int | None = None, seed: int = 0, time_scale: float = 1.0) -> Workload:
    """A BurstGPT trace: Timestamp (s), Model, Request tokens, Response tokens, Total tokens,
    Log Type. ``model``/``log_type`` keep only rows whose Model/Log Type equals it (case
    ignored). Rows with 0 response tokens are failed requests: dropped and counted."""
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    dropped = {"zero_output": 0, "zero_prompt": 0}
    filtered = 0
    want_m = model.strip().lower() if model else None
    want_l = log_type.strip().lower() if log_type else None
    with _open(p) as f:
        c = _Csv(p, f, ("timestamp", "request tokens", "response tokens"), ("model", "log type"))
        for want, k, col in ((want_m, 3, "Model"), (want_l, 4, "Log Type")):
            if want and c.idx[k] < 0:
                raise WorkloadError(f"{p}: line 1: cannot filter by {col}: no such column in the header "
                                    f"({', '.join(c.header)})")
        for line, (ts, cp, co, m, lt) in c.rows():
            if (want_m and (m or "").strip().lower() != want_m) or (want_l and (lt or "").strip().lower() != want_l):
                filtered += 1
                continue
            t = c.parse(line, 0, ts, _seconds, "seconds")
            pt = c.parse(line, 1, cp, _tokens, "a token count")
            ot = c.parse(line, 2, co, _tokens, "a token count")
            if not _drop(pt, ot, dropped):
                rows.append((t, pt, ot))
    if dropped["zero_output"]:
        logger.info("%s: dropped %d failed requests (0 response tokens)", p, dropped["zero_output"])
    return _imported(p, "burstgpt", rows, {"dropped": dropped, "failed": dropped["zero_output"],
                                           "filtered": filtered}, n, seed, time_scale)


def load_mooncake(path: str | Path, *, n: int | None = None, seed: int = 0, time_scale: float = 1.0) -> Workload:
    """A Mooncake trace: JSON lines with timestamp (ms), input_length, output_length
    (hash_ids, the prefix-cache block ids, are not used)."""
    p = Path(path)
    rows: list[tuple[float, int, int]] = []
    dropped = {"zero_output": 0, "zero_prompt": 0}
    for line, d in _json_lines(p):
        vals = []
        for key, conv in (("timestamp", _seconds), ("input_length", _tokens), ("output_length", _tokens)):
            if key not in d:
                raise WorkloadError(f"{p}: line {line}: no field {key!r}")
            v = d[key]
            try:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(v)
                vals.append(conv(v))
            except ValueError:
                raise WorkloadError(f"{p}: line {line}: field {key!r}: expected a number"
                                    f"{' (token count)' if key != 'timestamp' else ''}, got {v!r}") from None
        t, pt, ot = vals
        if not _drop(pt, ot, dropped):
            rows.append((t / 1000.0, pt, ot))
    return _imported(p, "mooncake", rows, {"dropped": dropped}, n, seed, time_scale)


def detect_format(path: str | Path) -> str:
    """azure, burstgpt, mooncake or kvpath, from the first non-blank line (and the extension
    for JSON lines)."""
    p = Path(path)
    line_no, first = 0, ""
    with _open(p) as f:
        try:
            for line_no, first in enumerate(f, 1):
                if first.strip():
                    break
        except UnicodeDecodeError:
            raise WorkloadError(f"{p}: line {line_no + 1}: not UTF-8 text") from None
    first = first.strip()
    if not first:
        raise WorkloadError(f"{p}: empty file")
    if first.startswith("{") or p.suffix.lower() in (".jsonl", ".json"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError) as e:
            col = f", column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise WorkloadError(f"{p}: line {line_no}{col}: invalid JSON: {e}") from None
        if "arrival_s" in keys:
            return "kvpath"
        if keys & {"input_length", "output_length"}:
            return "mooncake"
    else:
        head = {_norm(h) for h in next(csv.reader([first]))}
        if "contexttokens" in head or "generatedtokens" in head:
            return "azure"
        if "request tokens" in head or "response tokens" in head:
            return "burstgpt"
    raise WorkloadError(f"{p}: line {line_no}: cannot tell the workload format from {first[:120]!r}; "
                        f"pass format= one of {', '.join(FORMATS)}")


def load_file(path: str | Path, format: str = "auto", *, n: int | None = None, seed: int = 0,
              time_scale: float = 1.0, model: str | None = None, log_type: str | None = None) -> Workload:
    """A workload file in ``format`` (``auto``: ``detect_format``), sampled to ``n``
    (None: all) and time-scaled. ``model``/``log_type`` filter BurstGPT files only."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"workload file {p} does not exist" if not p.exists() else f"{p} is not a file")
    fmt = detect_format(p) if format == "auto" else format
    if fmt not in FORMATS:
        raise WorkloadError(f"format must be auto or one of {', '.join(FORMATS)}, got {format!r}")
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise WorkloadError(f"time scale factor must be a finite number > 0, got {time_scale}")
    if fmt != "burstgpt" and (model or log_type):
        raise WorkloadError(f"{p}: model= and log_type= filter BurstGPT files only (this is {fmt})")
    if fmt == "azure":
        return load_azure(p, n=n, seed=seed, time_scale=time_scale)
    if fmt == "burstgpt":
        return load_burstgpt(p, model=model, log_type=log_type, n=n, seed=seed, time_scale=time_scale)
    if fmt == "mooncake":
        return load_mooncake(p, n=n, seed=seed, time_scale=time_scale)
    w = Workload.from_jsonl(p)  # kvpath: arrivals kept as written
    w = w.sample(n, seed) if n is not None else w
    return w.scale_time(time_scale) if time_scale != 1.0 else w


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
