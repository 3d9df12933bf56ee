"""What the testbed benchmarks share: the datacenter-scale setup of bench_layer_push.py and
bench_placement.py (a 3x3x3 leaf-spine fabric with ecmp_seed 7, an Azure-2023-format
trace), running kvpath commands, and ranges over repeats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bridge_suite import write_azure

KVPATH = str(Path(sys.executable).with_name("kvpath"))
FABRIC = {"leaves": 3, "spines": 3, "hosts_per_leaf": 3, "ecmp_seed": 7}  # link rates: the caller's


def setup(out: Path, gbps: float, requests: int, seed: int) -> tuple[Path, Path]:
    """The fabric (every link at ``gbps``) and the trace (prompts 136-6,000 tokens with a
    median near 1,050, outputs 2-800 with a median near 50), written under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    fabric = out / "fabric.json"
    fabric.write_text(json.dumps({**FABRIC, "host_link_gbps": gbps, "spine_link_gbps": gbps}))
    trace = out / "azure.csv"
    write_azure(trace, requests, seed, ctx=(1050, 0.75, 136, 6000), gen=(50, 1.1, 2, 800))
    return fabric, trace


def run(cmd: list[str], what: str) -> str:
    """A kvpath command's stdout; exit 1 is a run the fidelity check marked (its summary
    says which), anything else stops the benchmark naming it."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{what} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def summary_row(s: dict) -> dict:
    """One run's datacenter numbers that the testbed benchmarks compare (from its summary):
    valid, repeat, TTFT mean and p99, TPOT mean, the push's share of the mean TTFT, and
    the mean TTFT parts (``parts``)."""
    dc = s["datacenter"]
    parts = dc.get("ttft_parts_mean_s") or {}
    ttft = dc["ttft_s"]["mean"]
    return {"valid": s["fidelity"]["valid"], "repeat": s.get("repeat", 0), "ttft_mean": ttft,
            "ttft_p99": dc["ttft_s"]["p99"], "tpot_mean": dc["tpot_s"]["mean"],
            "push_share": (parts.get("push") or 0.0) / ttft if ttft else None, "parts": parts}


def span(vals: list, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
    """min..max of the values (None left out), scaled and formatted; "-" when none."""
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    lo, hi = min(v) * scale, max(v) * scale
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}..{fmt.format(hi)}"
