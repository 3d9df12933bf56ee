"""``kvpath bridge report``: one HTML page with figures of one or more traces.

``write_report`` reads nothing from disk: it takes traces, writes ``index.html`` and its
PNGs (``report_figures.py``) into a directory and returns where they are. The page has a
summary table, then five sections: per-request Gantt timelines, the FCT slowdown CDF,
flows in flight, a ``dc`` broadcast-delay sweep of the first trace's workload in the
serving simulation, and each trace's flows replayed through a network backend against
their measured FCTs. ``docs/report.md`` describes each figure.
"""

from __future__ import annotations

import html
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from rich.console import Console
from rich.progress import Progress

from kvpath.bridge import report_figures as figs
from kvpath.bridge.backends import backend_type
from kvpath.bridge.compare import Errors, header_net_params, simulate, trace_flows
from kvpath.bridge.ns3_backend import Ns3Error
from kvpath.bridge.serving_sim import ServingConfig
from kvpath.bridge.serving_sim import simulate as serve
from kvpath.deployment import format_pools
from kvpath.trace import Trace
from kvpath.trace.header import META_BACKEND, META_SOURCE, TraceSetup
from kvpath.trace.metrics import TraceMetrics
from kvpath.workloads import Request

logger = logging.getLogger(__name__)

PROG = "kvpath bridge report"
DEFAULT_DELAYS = (0.0, 0.001, 0.005, 0.02, 0.1)
KINDS = ("gantt", "slowdown", "inflight", "dc-sweep", "scatter")
# every name a report writes: older figures matching these are removed so the page and
# the directory agree
PATTERNS = ("gantt-*.png", "slowdown-cdf.png", "inflight-*.png", "dc-sweep.png", "scatter-*.png")


@dataclass
class Report:
    index: Path
    figures: dict[str, list[Path]]  # kind (KINDS) -> the PNGs written, in page order
    notes: list[str] = field(default_factory=list)  # what was skipped, as the page says it


# -- numbers ----------------------------------------------------------------------------
def _pct(v: float) -> str:
    return f"{round(100 * v, 1) + 0.0:+.1f}%"  # + 0.0: a rounded -0.0 reads +0.0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def labels(names: Sequence[str], traces: Sequence[Trace]) -> list[str]:
    """``mode (source/backend)`` per trace; the name (path) is added where two would read
    alike, and the position where even that does."""
    out = []
    for t in traces:
        extra = "/".join(str(x) for x in (t.header.meta.get(META_SOURCE), t.header.meta.get(META_BACKEND)) if x)
        out.append(f"{t.header.mode or '?'}" + (f" ({extra})" if extra else ""))
    out = [f"{lab} [{n}]" if out.count(lab) > 1 else lab for lab, n in zip(out, names)]
    return [f"{lab} #{i}" if out.count(lab) > 1 else lab for i, lab in enumerate(out, 1)]


def workload(trace: Trace) -> list[Request]:
    """The trace's requests as a workload. A failed request received no tokens but asked
    for some: lengths are raised to the workload's minimum of 1."""
    return [Request(q.request_id, max(q.arrival_s, 0.0), max(q.prompt_tokens, 1), max(q.output_tokens, 1))
            for q in sorted(trace.requests, key=lambda q: q.arrival_s)]


# -- the dc sweep -------------------------------------------------------------------------
def dc_sweep(trace: Trace, delays: Sequence[float], progress: Progress) -> dict[str, Any]:
    """The trace's workload re-simulated (flow backend) in dc at each delay and in ecmp and
    cc once. Raises ValueError when the trace cannot be re-simulated."""
    setup = TraceSetup(trace)
    spec = setup.fabric
    if setup.pools is None:
        raise ValueError("no meta.pools and no p_instance/d_instance in the requests: the pools are unknown")
    (n_p, n_d), reqs = setup.pools, workload(trace)
    itm, itm_note = setup.iteration_time_or_preset()
    base = dict(pools=(n_p, n_d), backend="flow", scale_s=trace.header.scale_s, time_scale=setup.time_scale,
                net=header_net_params(setup))
    if setup.reserve_at is not None:
        base["reserve_at"] = setup.reserve_at
    runs = [("dc", d) for d in delays] + [("ecmp", 0.0), ("cc", 0.0)]
    task = progress.add_task("dc sweep", total=len(runs))
    out: dict[str, Any] = {"dc": [], "refs": {}}
    for mode, delay in runs:
        sim, _ = serve(spec, reqs, ServingConfig(mode=mode, dc_delay_s=delay, **base), itm)
        if mode == "dc":
            out["dc"].append(TraceMetrics.of(sim).to_dict())
        else:
            out["refs"][mode] = TraceMetrics.of(sim).to_dict()
        progress.advance(task)
    out.update(base, spec=spec, pools=format_pools(n_p, n_d), requests=len(reqs), itm_note=itm_note)
    return out


# -- the sections ---------------------------------------------------------------------------
def _sweep_items(name: str, trace: Trace, delays: Sequence[float], out: Path,
                 progress: Progress) -> tuple[list[figs.Item], str]:
    try:
        r = dc_sweep(trace, delays, progress)
    except ValueError as e:
        return [figs.Item(f"the first trace ({name}) cannot be re-simulated: {e}")], ""
    p = figs.sweep_plot(delays, r["dc"], r["refs"], out / "dc-sweep.png", f"dc sweep: {len(delays)} delays")
    s = r["spec"]
    text = (f"The first trace's workload ({r['requests']} requests of {name}) re-simulated by the serving simulation "
            f"(flow backend) on its fabric ({s.leaves} leaves x {s.spines} spines, {s.spine_link_gbps:g} Gbit/s "
            f"spine links), pools {r['pools']}, scale_s {r['scale_s']:g}, compute time scale {r['time_scale']:g}: "
            f"dc at each broadcast delay (solid), ecmp and cc once (dashed). "
            f"{r['itm_note'][0].upper()}{r['itm_note'][1:]}.")
    rows = [(f"dc, {d * 1e3:g} ms", m) for d, m in zip(delays, r["dc"])] + list(r["refs"].items())
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{_ms(m['fct_p99_s'])}</td><td>{_ms(m['ttft_mean_s'])}</td></tr>"
                    for k, m in rows)
    head = "<tr><th>run</th><th>FCT p99 (ms)</th><th>TTFT mean (ms)</th></tr>"
    return [figs.Item(text, p, "dc sweep")], f'<table id="sweep">{head}{table}</table>'


def _scatter_item(i: int, t: Trace, lab: str, out: Path, backend: str) -> figs.Item:
    if not t.flows:
        return figs.Item(f"{lab}: the trace has no flows: nothing to replay (a pull-connector run records none).")
    try:
        setup = TraceSetup(t)
        params = header_net_params(setup)
        flows, measured = trace_flows(t)
        simulated = simulate(backend, setup.fabric, flows, params)
    except (ValueError, Ns3Error) as e:  # a flow across the spines without a path, no ns-3, a bad header
        return figs.Item(f"{lab}: the flows cannot be replayed: {e}")
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero measured FCT makes an error inf, not a crash
        err = Errors.of(measured, simulated)
    p = figs.scatter_plot(measured, simulated, out / f"scatter-{i}.png", lab, backend)
    return figs.Item(
        f"{lab}: {err.n} flows replayed with the {backend} backend on the trace's fabric, each on its measured "
        f"spine (burst_bytes {params.burst_bytes}, overhead_s {params.overhead_s:g}, efficiency "
        f"{params.efficiency:g}). Relative error, simulated vs measured: mean {_pct(err.mean)}, "
        f"p99 {_pct(err.p99)}.", p, f"scatter {i}")


def _scatter_items(traces: list[Trace], labs: list[str], out: Path, backend: str,
                   progress: Progress) -> list[figs.Item]:
    items = []
    task = progress.add_task(f"replay ({backend})", total=len(traces))
    for i, (t, lab) in enumerate(zip(traces, labs), 1):
        items.append(_scatter_item(i, t, lab, out, backend))
        progress.advance(task)
    return items


# -- the page -----------------------------------------------------------------------------
CSS = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
       "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}"
       "td:nth-child(-n+3){text-align:left}img{max-width:100%}figcaption{font-size:90%;color:#333}"
       ".note{color:#a40;font-style:italic}")


def _summary(names: list[str], traces: list[Trace]) -> str:
    head = ("#", "trace", "mode", "source", "requests", "flows", "FCT mean (ms)", "FCT p99 (ms)", "TTFT mean (ms)",
            "TTFT p99 (ms)", "TPOT mean (ms)")
    rows = []
    for i, (n, t) in enumerate(zip(names, traces), 1):
        m = TraceMetrics.of(t).to_dict()
        cells = [str(i), n, t.header.mode, str(t.header.meta.get(META_SOURCE, "")), str(len(t.requests)),
                 str(len(t.flows)), *(_ms(m[k]) for k in ("fct_mean_s", "fct_p99_s", "ttft_mean_s", "ttft_p99_s",
                                                           "tpot_mean_s"))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return ('<table id="summary"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _section(kind: str, title: str, items: list[figs.Item], extra: str = "") -> str:
    parts = [f'<section id="{kind}"><h2>{html.escape(title)}</h2>']
    for it in items:
        if it.path is None:
            parts.append(f'<p class="note">{html.escape(it.text)}</p>')
        else:
            parts.append(f'<figure class="{kind}"><img src="{html.escape(it.path.name)}" alt="{html.escape(it.alt)}">'
                         f"<figcaption>{html.escape(it.text)}</figcaption></figure>")
    return "\n".join([*parts, extra, "</section>"])


def _named(traces: Sequence[Trace | tuple[str, Trace]]) -> tuple[list[str], list[Trace]]:
    pairs = [t if isinstance(t, tuple) else (f"trace {i}", t) for i, t in enumerate(traces, 1)]
    return [n for n, _ in pairs], [t for _, t in pairs]


def write_report(traces: Sequence[Trace | tuple[str, Trace]], out_dir: str | Path, *, backend: str = "flow",
                 dc_delays: Sequence[float] = DEFAULT_DELAYS, gantt_requests: int = 40,
                 show_progress: bool = True) -> Report:
    """Write ``out_dir/index.html`` and its figures for ``traces`` (each a Trace or a
    (name, Trace)); the dc sweep takes the first. Raises ValueError on bad arguments."""
    names, ts = _named(traces)
    if not ts:
        raise ValueError("give at least one trace")
    empty = [n for n, t in zip(names, ts) if not t.requests]
    if empty:
        raise ValueError(f"empty trace(s), no requests: {', '.join(empty)}")
    backend_type(backend)  # a ValueError naming the registered backends
    if not dc_delays or any(not math.isfinite(d) or d < 0 for d in dc_delays):
        raise ValueError(f"dc delays must be finite numbers >= 0, at least one, got {list(dc_delays)}")
    if gantt_requests < 1:
        raise ValueError(f"gantt_requests must be >= 1, got {gantt_requests}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labs = labels(names, ts)
    with Progress(console=Console(stderr=True), transient=True, disable=not show_progress) as progress:
        sweep, sweep_table = _sweep_items(names[0], ts[0], dc_delays, out, progress)
        sections = [("gantt", "1. Per-request timeline", figs.gantt_items(names, ts, labs, out, gantt_requests), ""),
                    ("slowdown", "2. FCT slowdown CDF", figs.slowdown_items(ts, labs, out), ""),
                    ("inflight", "3. KV flows in flight", figs.inflight_items(ts, labs, out), ""),
                    ("dc-sweep", "4. dc broadcast-delay sweep (simulated)", sweep, sweep_table),
                    ("scatter", f"5. Measured vs simulated FCT ({backend})",
                     _scatter_items(ts, labs, out, backend, progress), "")]
    body = "\n".join(_section(*s) for s in sections)
    page = (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{PROG}</title><style>{CSS}</style></head>'
            f"<body>\n<h1>{PROG}</h1>\n<p>{len(ts)} trace(s); times in milliseconds on each trace's own clock "
            f"(testbed time for a testbed trace).</p>\n{_summary(names, ts)}\n{body}\n</body></html>\n")
    index = out / "index.html"
    index.write_text(page)
    figures = {kind: [it.path for it in items if it.path] for kind, _, items, _ in sections}
    _remove_stale(out, {p for ps in figures.values() for p in ps})
    notes = [it.text for _, _, items, _ in sections for it in items if it.path is None]
    for n in notes:
        logger.warning("%s", n)
    logger.info("report written to %s", index)
    return Report(index, figures, notes)


def _remove_stale(out: Path, written: set[Path]) -> None:
    for pattern in PATTERNS:
        for p in out.glob(pattern):
            if p not in written:
                logger.info("removing %s: an older report's figure this page does not show", p)
                p.unlink()
