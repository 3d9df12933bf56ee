"""Runs one or more modes of a testbed run one after another (same workload, same
seed), writes each mode's rows and summary, and prints them side by side."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpath.fabric import FabricSpec
from testbed.orchestrator import RunConfig, run
from testbed.run_report import fidelity, join, summarize

logger = logging.getLogger(__name__)


def run_one(cfg: RunConfig, console: Console) -> dict[str, Any]:
    data = run(cfg, console)
    spec = FabricSpec.resolve(cfg.fabric)
    j = join(data, lambda host: spec.host_ip(host) if host else None)
    fid = fidelity(data, j, data.lone_flow_ratio)
    summary = summarize(data, j, fid)
    out = Path(cfg.out)
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in j.requests))
    (out / "flows.jsonl").write_text("".join(json.dumps(f) + "\n" for f in j.flows))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "collected.json").write_text(json.dumps({k: v for k, v in asdict(data).items()
                                                    if k in ("decisions", "lanes_known", "flow_bytes", "link_bytes",
                                                             "cpu_idle", "lone_flow_ratio", "config")}, indent=1))
    return summary


def _fmt(st: dict[str, Any], key: str, ms: bool = True) -> str:
    v = st[key]
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if ms else f"{v:.2f}"


def print_summaries(summaries: list[dict[str, Any]], console: Console) -> None:
    for unit in ("testbed", "datacenter"):
        t = Table(title=f"per mode, {unit} time (ms)")
        for c in ("mode", "ok/all", "FCT mean", "FCT p99", "slowdown p50", "slowdown p99", "TTFT mean", "TTFT p99",
                  "TPOT mean", "path agreement", "fidelity"):
            t.add_column(c)
        for s in summaries:
            u = s[unit]
            agree = "-" if s["path_agreement"] is None else f"{100 * s['path_agreement']:.0f}% of {s['pushes_with_path']}"
            fid = "valid" if s["fidelity"]["valid"] else "[red]INVALID[/red]: " + "; ".join(s["fidelity"]["problems"])
            t.add_row(s["mode"], f"{s['ok']}/{s['requests']}", _fmt(u["fct_s"], "mean"), _fmt(u["fct_s"], "p99"),
                      _fmt(u["slowdown"], "p50", False), _fmt(u["slowdown"], "p99", False), _fmt(u["ttft_s"], "mean"),
                      _fmt(u["ttft_s"], "p99"), _fmt(u["tpot_s"], "mean"), agree, fid)
        console.print(t)


def run_modes(cfgs: list[RunConfig], out: str, console: Console) -> int:
    summaries = []
    for cfg in cfgs:
        console.rule(f"mode {cfg.mode}")
        summaries.append(run_one(cfg, console))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "summary.json").write_text(json.dumps(summaries, indent=1))
    print_summaries(summaries, console)
    return 0 if all(s["fidelity"]["valid"] and s["failed"] == 0 for s in summaries) else 1
