"""Workload files: importers of public LLM-serving traces and this project's own jsonl
(nothing is downloaded).

- the Azure LLM inference traces 2023 and 2024 (``TIMESTAMP, ContextTokens,
  GeneratedTokens``);
- BurstGPT (``Timestamp, Model, Request tokens, Response tokens, ...``);
- Mooncake (jsonl: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``);
- ``kvpath``: ``Workload.to_jsonl``'s files.

The format is detected from the first line. Arrivals are made relative to the first
request; then the trace is optionally sampled and time-scaled. Every error names the
file, the line and, for a CSV, the column.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

import numpy as np

from kvpath.workloads.model import Request, Workload, WorkloadError, json_lines, open_text, sample_index

__all__ = ["FORMATS", "parse_datetime", "load_azure", "load_burstgpt", "load_mooncake", "load_kvpath",
           "detect_format", "load_file"]

logger = logging.getLogger(__name__)

FORMATS = ("azure", "burstgpt", "mooncake", "kvpath")


# ---- reading files ---------------------------------------------------------------------
def _norm(h: str) -> str:
    """Header names compare case-insensitively, spaces and underscores alike."""
    return " ".join(h.replace("_", " ").lower().split())


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
    ranks = sample_index(len(rows), len(rows) if n is None else n, seed)  # positions in arrival order
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
    with open_text(p) as f:
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
    with open_text(p) as f:
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
    for line, d in json_lines(p):
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


def load_kvpath(path: str | Path) -> Workload:
    """A ``Workload.to_jsonl`` file: one Request per JSON line, arrivals kept as written."""
    return Workload.from_jsonl(path)


def detect_format(path: str | Path) -> str:
    """azure, burstgpt, mooncake or kvpath, from the first non-blank line (and the extension
    for JSON lines)."""
    p = Path(path)
    line_no, first = 0, ""
    with open_text(p) as f:
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
    w = load_kvpath(p)  # arrivals kept as written
    w = w.sample(n, seed) if n is not None else w
    return w.scale_time(time_scale) if time_scale != 1.0 else w
