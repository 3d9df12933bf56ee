"""Figures of a testbed run: the modes of one run side by side, from their traces."""

from __future__ import annotations

from pathlib import Path

from kvpath.plotting import cdf, plain_log_x, pyplot, save_figure
from kvpath.trace import Trace


def compare_modes(traces: dict[str, Trace], path: Path) -> Path | None:
    """One PNG with three CDFs per mode: push FCT, FCT slowdown (FCT / standalone FCT)
    and TTFT, in testbed milliseconds. Returns None when no mode finished a request."""
    if not any(t.requests for t in traces.values()):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, t in traces.items():
        cdf(axes[0], [f.fct_s * 1e3 for f in t.flows], mode)
        cdf(axes[1], [f.fct_s / f.standalone_fct_s for f in t.flows if f.standalone_fct_s], mode)
        cdf(axes[2], [q.ttft_s * 1e3 for q in t.requests if q.ttft_s is not None], mode)
    titles = ("KV push FCT", "FCT slowdown (FCT / alone)", "TTFT")
    units = ("ms (testbed time)", "x", "ms (testbed time)")
    for ax, title, unit in zip(axes, titles, units):
        ax.set_title(title)
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(loc="lower right")
    if axes[1].has_data():
        plain_log_x(axes[1])
        axes[1].set_xticks([1, 1.5, 2, 3, 5, 10])
    return save_figure(fig, path)
