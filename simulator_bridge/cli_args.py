"""Arguments that several ``kvpath bridge`` commands share, declared once."""

from __future__ import annotations

import argparse


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and the serving model: the published study's shape by default."""
    p.add_argument("--workload", default="zipf", help="zipf, poisson or a trace file (docs/workloads.md)")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt", type=int, default=1024)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--pd-ratio", type=float, default=20.0)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--accelerator", default="h100")
