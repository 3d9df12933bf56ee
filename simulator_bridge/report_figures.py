"""The figures of ``kvpath bridge report``: one function per kind, each writing one PNG
(matplotlib, Agg) and returning its path, or None when the trace has nothing to draw;
and, for the sections that need no simulation, the figures with their captions
(:class:`Item`). The sections that simulate (the dc sweep, the replay) are in
``report.py``.

Times are the trace's own clock (testbed time for a testbed trace), so no figure mixes
clocks except where a caption says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvpath.plotting import cdf, plain_log_x, pyplot, save_figure
from kvpath.trace import FlowRecord, RequestRecord, Trace

# (field of the start, field of the end, legend label, colour) per Gantt bar, in phase order
PHASES = (("arrival_s", "prefill_start_s", "queue", "0.8"),
          ("prefill_start_s", "prefill_end_s", "prefill", "C0"),
          ("push_start_s", "push_end_s", "KV transfer", "C1"),
          ("decode_start_s", "completion_s", "decode", "C2"))
STYLES = ("-", "--", ":", "-.")


@dataclass
class Item:
    """A figure (path set) or a note (path None) of a section."""

    text: str
    path: Path | None = None
    alt: str = ""


def first_requests(trace: Trace, n: int) -> list[RequestRecord]:
    """The first ``n`` requests by arrival (ties in file order)."""
    return sorted(trace.requests, key=lambda q: q.arrival_s)[:n]


def gantt(trace: Trace, n: int, path: Path, title: str) -> Path | None:
    """One row per request (the first ``n`` by arrival): a bar per phase the record has
    both ends of, a tick at the first token. None when no request has any phase."""
    reqs = first_requests(trace, n)
    bars = [[(getattr(q, a), getattr(q, b)) for a, b, _, _ in PHASES] for q in reqs]
    if not any(a is not None and b is not None and b > a for row in bars for a, b in row):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.22 * len(reqs)))
    labelled: set[str] = set()
    for y, row in enumerate(bars):
        for (a, b), (_, _, label, colour) in zip(row, PHASES):
            if a is None or b is None or b <= a:
                continue  # a phase the record lacks, or one that took no time (nothing to see)
            ax.barh(y, b - a, left=a, height=0.7, color=colour,
                    label=None if label in labelled else label)
            labelled.add(label)
    ticks = [(y, q.first_token_s) for y, q in enumerate(reqs) if q.first_token_s is not None]
    if ticks:
        ax.plot([t for _, t in ticks], [y for y, _ in ticks], "k|", markersize=9, label="first token")
    ax.set_yticks(range(len(reqs)))
    ax.set_yticklabels([q.request_id for q in reqs], fontsize=7)
    ax.invert_yaxis()  # the earliest arrival on top, as one reads a timeline
    ax.set_xlabel("s (trace clock)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def slowdowns(trace: Trace) -> np.ndarray:
    """FCT / standalone FCT of each flow that has a standalone FCT > 0."""
    return np.array([f.fct_s / f.standalone_fct_s for f in trace.flows if f.standalone_fct_s], dtype=float)


def slowdown_cdf(series: Sequence[tuple[str, np.ndarray]], path: Path) -> Path | None:
    """One CDF line per (label, slowdowns); None when every series is empty."""
    if not any(v.size for _, v in series):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, (label, v) in enumerate(series):
        cdf(ax, list(v), label)
        if v.size:
            ax.lines[-1].set_linestyle(STYLES[k % len(STYLES)])  # modes that coincide stay visible
    ax.set_xlabel("FCT / standalone FCT")
    ax.set_ylabel("fraction of flows")
    ax.set_title("KV flow FCT slowdown")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    lo = min(float(v.min()) for _, v in series if v.size)
    hi = max(float(v.max()) for _, v in series if v.size)
    if lo > 0 and hi / lo > 10:  # slowdowns can span orders of magnitude under contention
        plain_log_x(ax)
    return save_figure(fig, path)


def in_flight(flows: Sequence[FlowRecord]) -> tuple[np.ndarray, np.ndarray]:
    """The number of flows in flight after each distinct start or end time. A flow is in
    flight on [start, end): one ending when another starts does not overlap it."""
    if not flows:
        return np.zeros(0), np.zeros(0, dtype=int)
    t = np.array([f.start_s for f in flows] + [f.end_s for f in flows], dtype=float)
    d = np.array([1] * len(flows) + [-1] * len(flows))
    order = np.lexsort((d, t))  # at one instant ends (-1) before starts (+1)
    t, count = t[order], np.cumsum(d[order])
    last = np.r_[t[1:] != t[:-1], True]  # the count after every event at that instant
    return t[last], count[last]


def inflight_plot(trace: Trace, path: Path, title: str) -> Path | None:
    t, count = in_flight(trace.flows)
    if not t.size:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.step(t, count, where="post", color="C1")
    ax.set_xlabel("s (trace clock)")
    ax.set_ylabel("KV flows in flight")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def sweep_plot(delays: Sequence[float], dc: Sequence[dict[str, float]], refs: dict[str, dict[str, float]],
               path: Path, title: str) -> Path:
    """FCT p99 and TTFT mean against the dc broadcast delay; ``refs`` (mode -> metrics)
    are drawn as horizontal lines, their modes not having a delay."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.array(delays) * 1e3
    for ax, key, name in ((axes[0], "fct_p99_s", "KV flow FCT p99"), (axes[1], "ttft_mean_s", "TTFT mean")):
        ax.plot(x, [r[key] * 1e3 for r in dc], "o-", color="C2", label="dc")
        for k, (mode, r) in enumerate(refs.items()):
            ax.axhline(r[key] * 1e3, linestyle="--", color=f"C{k}", label=mode)
        ax.set_xlabel("dc broadcast delay (ms, trace clock)")
        ax.set_ylabel("ms (trace clock)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        positive = x[x > 0]
        if positive.size and x.max() / positive.min() > 10:
            lin = float(positive.min())
            ax.set_xscale("symlog", linthresh=lin)  # log spacing, and 0 stays on the axis
            ax.set_xlim(left=-0.3 * lin if x.min() == 0 else None)  # no empty negative decade
        ax.set_xticks(x)
        ax.set_xticklabels([f"{v:g}" for v in x])
    fig.suptitle(title)
    return save_figure(fig, path)


def scatter_plot(measured: np.ndarray, simulated: np.ndarray, path: Path, title: str, backend: str) -> Path:
    """Measured against simulated FCT per flow, with the y = x line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    m, s = measured * 1e3, simulated * 1e3
    ax.scatter(m, s, s=10, alpha=0.6, color="C0", label=f"flows (n={m.size})")
    both = np.r_[m, s]
    lo, hi = float(both.min()), float(both.max())
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="y = x")
    if lo > 0 and hi / lo > 10:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured FCT (ms, trace clock)")
    ax.set_ylabel(f"simulated FCT, {backend} (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, path)


# -- a section's figures with their captions -------------------------------------------------
def gantt_items(names: list[str], traces: list[Trace], labs: list[str], out: Path, n: int) -> list[Item]:
    items = []
    for i, (t, lab) in enumerate(zip(traces, labs), 1):
        shown = len(first_requests(t, n))
        p = gantt(t, n, out / f"gantt-{i}.png", f"{lab}: first {shown} requests")
        if p is None:
            items.append(Item(f"{lab} ({names[i - 1]}): no request has both ends of any phase: no timeline."))
            continue
        items.append(Item(
            f"{lab} ({names[i - 1]}): the first {shown} of {len(t.requests)} requests by arrival. Bars: queue (arrival "
            "to prefill start), prefill, KV transfer (push start to push end), decode (decode start to completion); "
            "tick: first token. Trace clock.", p, f"gantt {i}"))
    return items


def slowdown_items(traces: list[Trace], labs: list[str], out: Path) -> list[Item]:
    series = [(lab, slowdowns(t)) for t, lab in zip(traces, labs)]
    p = slowdown_cdf(series, out / "slowdown-cdf.png")
    missing = [lab for lab, v in series if not v.size]
    if p is None:
        return [Item("no trace has a flow with a standalone FCT: no slowdown CDF.")]
    text = "FCT / standalone_fct_s of each KV flow that has a standalone FCT, one line per trace (n: its flows)."
    if missing:
        text += f" No such flow in: {', '.join(missing)}."
    return [Item(text, p, "slowdown cdf")]


def inflight_items(traces: list[Trace], labs: list[str], out: Path) -> list[Item]:
    items = []
    for i, (t, lab) in enumerate(zip(traces, labs), 1):
        p = inflight_plot(t, out / f"inflight-{i}.png", f"{lab}: KV flows in flight")
        if p is None:
            items.append(Item(f"{lab}: the trace has no flows."))
            continue
        tt, c = in_flight(t.flows)
        span = float(tt[-1] - tt[0])
        mean = float((c[:-1] * np.diff(tt)).sum() / span) if span > 0 else float(c.max())
        items.append(Item(f"{lab}: flows started and not yet ended, stepping at each start and end "
                           f"({len(t.flows)} flows; max {int(c.max())}, time-weighted mean {mean:.2f} from the first "
                           "start to the last end). Trace clock.", p, f"inflight {i}"))
    return items
