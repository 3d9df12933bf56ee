"""Plotting helpers that the testbed's and the bridge's figures share, so both draw alike:
matplotlib on the file-only Agg backend, a step CDF, a plain-numbered log axis and one
way to save a figure. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["DPI", "pyplot", "cdf", "plain_log_x", "save_figure"]

logger = logging.getLogger(__name__)

DPI = 110


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, never a display, also on a
    machine that has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(ax: Any, values: Sequence[float], label: str) -> None:
    """A step CDF of ``values`` labelled with its count; nothing for no values."""
    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})")


def plain_log_x(ax: Any) -> None:
    """A logarithmic x axis whose major ticks read as plain numbers (1.5, not 1.5x10^0)
    and whose minor ticks are unlabelled."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write ``path`` (its directory created) at DPI, close the figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    logger.info("figure written to %s", path)
    return path
