"""``load_workload``: a workload by name (a generator) or by path (a file reader)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvpath.workloads.generators import GENERATORS, poisson, zipf
from kvpath.workloads.importers import load_file
from kvpath.workloads.model import Workload, WorkloadError

logger = logging.getLogger(__name__)


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
