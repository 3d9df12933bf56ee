"""benchmarks/serve_compare.py's rows and tables: one row per grid point and round with
its verdict, the rows aggregated over the rounds, and the printed tables (a module the
script imports, not a script)."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rich import box
from rich.table import Table

from kvpath.request_timeline import PARTS as TIMELINE_ALL_PARTS


@dataclass
class RunRow:
    """One grid point of one session (one round of one mode)."""

    engine: str
    mode: str
    round: int
    input_len: int
    output_len: int
    rate: float
    prompts: int
    completed: int | None = None
    failed: int | None = None
    ttft_mean_ms: float | None = None
    ttft_median_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_mean_ms: float | None = None
    req_s: float | None = None
    duration_s: float | None = None
    cpu_idle_median: float | None = None  # % of the machine, during the bench's measured window
    cpu_parts_median: dict[str, float] = field(default_factory=dict)  # CPU_PARTS: % of the machine each used
    cpu_idle_at_rest: float | None = None  # % idle with the engines up and no request (this session, before the bench)
    # CpuSample.engines_wait (JSON only): engine threads runnable without a core, s per s. Not a
    # contention measure on its own: vLLM's spinning threads count as waiting too (2-3 s/s here
    # with KVPathConnector engines at 1 req/s, 4-5 with the in-tree pull connector)
    engines_wait_median: float | None = None
    # per second of the window: [s into it, idle, *CPU_PARTS, engines_wait]
    cpu_samples: list[list[float]] = field(default_factory=list)
    machine: list[str] = field(default_factory=list)  # the testbed's fidelity problems: the machine did not keep up
    connector: list[str] = field(default_factory=list)  # failed requests, lost KV, lost or failed pushes
    evidence: list[str] = field(default_factory=list)  # log lines behind `connector`
    fidelity: dict[str, Any] = field(default_factory=dict)
    pushes: int | None = None  # kvpath modes: P's push records in the window
    # kvpath modes: the median ms of each part of a request (kvpath.request_timeline.PARTS)
    # over the window's ok pushes, from P's and D's connector records; None where unknown
    timeline_ms: dict[str, float | None] = field(default_factory=dict)
    kv_bytes_on_spines: int | None = None  # what the spines forwarded from P hosts to D hosts (every mode)
    error: str | None = None  # nothing measured: why
    result_file: str | None = None
    wall_s: float | None = None  # the bench process, start to exit
    session_setup_s: float | None = None  # this mode's fabric, proxy, engines and warm-up (time model's SETUP_S)

    @property
    def key(self) -> tuple[str, str, int, int, float]:
        return (self.engine, self.mode, self.input_len, self.output_len, self.rate)

    @property
    def cpu_others_median(self) -> float | None:
        return self.cpu_parts_median.get("others")

    @property
    def valid(self) -> bool:
        return self.error is None and not self.machine and not self.connector

    def verdict(self) -> str:
        if self.error:
            return f"no result: {self.error}"
        parts = [f"machine: {'; '.join(self.machine)}"] if self.machine else []
        parts += [f"connector: {'; '.join(self.connector)}"] if self.connector else []
        return "valid" if not parts else "INVALID (" + " | ".join(parts) + ")"


# -- the table --------------------------------------------------------------------------

def number_text(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def spread(values: Iterable[float | None], digits: int = 0) -> str:
    """``median (min..max)`` of the values that exist; ``-`` if none; one value alone."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return number_text(v[0], digits)
    return f"{number_text(statistics.median(v), digits)} ({number_text(min(v), digits)}..{number_text(max(v), digits)})"


METRICS = (("TTFT mean", "ttft_mean_ms", 0), ("TTFT median", "ttft_median_ms", 0),
           ("TTFT p99", "ttft_p99_ms", 0), ("TPOT mean", "tpot_mean_ms", 1), ("req/s", "req_s", 2))


def short(problem: str) -> str:
    """A problem without its numbers, to count it over rounds (each round's numbers are in its row)."""
    for start, label in (("CPU idle median", "CPU idle < 10%"),
                         ("a lone flow", "lone flow outside 0.9-1.1 of the link rate"),
                         ("spine counters", "spine bytes outside 0.98-1.15 x pushed"),
                         ("processes outside", "other processes used the CPU")):
        if problem.startswith(start):
            return label
    return re.sub(r"\b\d+(\.\d+)?\b", "N", problem)


def aggregate(rows: Sequence[RunRow]) -> list[dict[str, Any]]:
    """One line per (engine, mode, input len, output len, rate), in the order first run:
    every metric as median (min..max) over the rounds, CPU idle likewise, and the verdict
    (how many rounds were valid, and each problem with the rounds it hit)."""
    groups: dict[tuple, list[RunRow]] = {}
    for r in rows:
        groups.setdefault(r.key, []).append(r)
    out = []
    for (engine, mode, i, o, rate), rs in groups.items():
        line: dict[str, Any] = {"engine": engine, "mode": mode, "input_len": i, "output_len": o, "rate": rate,
                                "rounds": len(rs), "valid_rounds": sum(r.valid for r in rs)}
        for label, key, digits in METRICS:
            vals = [getattr(r, key) for r in rs]
            line[key] = {"median": statistics.median([v for v in vals if v is not None]) if any(
                v is not None for v in vals) else None, "values": vals, "text": spread(vals, digits)}
        for key, attr, digits in (("cpu_idle", "cpu_idle_median", 0), ("cpu_others", "cpu_others_median", 0),
                                  ("cpu_at_rest", "cpu_idle_at_rest", 0), ("engines_wait", "engines_wait_median", 2)):
            vals = [getattr(r, attr) for r in rs]
            line[key] = {"values": vals, "text": spread(vals, digits)}
        line["ok"] = f"{sum(r.completed or 0 for r in rs)}/{sum(r.prompts for r in rs)}"
        line["timeline_ms"] = {part: spread([r.timeline_ms.get(part) for r in rs]) for part in TIMELINE_PARTS
                               if any(r.timeline_ms.get(part) is not None for r in rs)}
        problems: dict[str, int] = {}
        for r in rs:
            for p in ([f"no result: {r.error}"] if r.error else []) + [f"machine: {short(m)}" for m in r.machine] + \
                    [f"connector: {short(c)}" for c in r.connector]:
                problems[p] = problems.get(p, 0) + 1
        line["problems"] = problems
        line["verdict"] = (f"valid {line['valid_rounds']}/{len(rs)}"
                           + "".join(f"; {p} (x{n})" for p, n in problems.items()))
        out.append(line)
    return out


def table(lines: Sequence[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for c in ("engine", "mode", "input len", "output len", "QPS", *(m[0] for m in METRICS), "ok", "CPU idle %",
              "idle at rest %", "others %", "fidelity"):
        t.add_column(c, overflow="fold")
    for ln in lines:
        style = None if ln["valid_rounds"] == ln["rounds"] else "yellow"
        t.add_row(ln["engine"], ln["mode"], str(ln["input_len"]), str(ln["output_len"]), f"{ln['rate']:g}",
                  *(ln[m[1]]["text"] for m in METRICS), ln["ok"], ln["cpu_idle"]["text"], ln["cpu_at_rest"]["text"],
                  ln["cpu_others"]["text"],
                  ln["verdict"], style=style)
    return t


# the parts a run's connector records know: request_timeline's, but for those that end
# at the client (`vllm bench serve` keeps no per-request send times)
TIMELINE_PARTS = tuple(name for name, start, end in TIMELINE_ALL_PARTS if "client" not in (start + end))


def breakdown_table(lines: Sequence[dict[str, Any]], title: str) -> Table | None:
    """Where a request's time went, per line that has connector records (kvpath modes):
    each part's median ms over a round's requests, as median (min..max) over the rounds,
    beside the bench's TTFT median. What the parts leave of it is the client, the proxy,
    P's HTTP front end and D's first token."""
    mine = [ln for ln in lines if ln.get("timeline_ms")]
    if not mine:
        return None
    t = Table(title=title, box=box.SIMPLE_HEAD)
    for c in ("engine", "mode", "in", "out", "QPS", *TIMELINE_PARTS, "TTFT median"):
        t.add_column(c, overflow="fold")
    for ln in mine:
        t.add_row(ln["engine"], ln["mode"], str(ln["input_len"]), str(ln["output_len"]), f"{ln['rate']:g}",
                  *(ln["timeline_ms"].get(part, "-") for part in TIMELINE_PARTS), ln["ttft_median_ms"]["text"])
    return t
