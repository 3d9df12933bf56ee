"""Figures of a testbed run: the modes of one run side by side, from their traces."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kvpath.trace import Trace

logger = logging.getLogger(__name__)


def _cdf(ax, values: list[float], label: str) -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})")


def compare_modes(traces: dict[str, Trace], path: Path) -> Path | None:
    """One PNG with three CDFs per mode: push FCT, FCT slowdown (FCT / standalone FCT)
    and TTFT, in testbed milliseconds. Returns None when no mode finished a request."""
    if not any(t.requests for t in traces.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, t in traces.items():
        _cdf(axes[0], [f.fct_s * 1e3 for f in t.flows], mode)
        _cdf(axes[1], [f.fct_s / f.standalone_fct_s for f in t.flows if f.standalone_fct_s], mode)
        _cdf(axes[2], [q.ttft_s * 1e3 for q in t.requests if q.ttft_s is not None], mode)
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
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        axes[1].set_xscale("log")
        axes[1].set_xticks([1, 1.5, 2, 3, 5, 10])
        axes[1].xaxis.set_major_formatter(ScalarFormatter())
        axes[1].xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("figure written to %s", path)
    return path
