"""Runs one or more modes of a testbed run one after another (same workload, same
seed), writes each mode's rows and summary, and prints them side by side."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpath.fabric import FabricSpec
from kvpath.trace import FiveTuple, FlowRecord, Header, RequestRecord, TraceWriter, read_trace
from kvpath.trace_formats import to_fct_txt, to_request_metrics_csv, to_simai_csv
from kvpath.trace_header import META_BURST, META_DROPS, META_POOLS, META_QUEUE, META_RETRANS
from kvpath.testbed.orchestrator import RunData, run
from kvpath.testbed.run_config import RunConfig
from kvpath.decision_replay import ReplayError, replay
from kvpath.testbed.plots import compare_modes
from kvpath.testbed.run_report import Joined, fidelity, join, summarize

logger = logging.getLogger(__name__)


def run_one(cfg: RunConfig, console: Console) -> dict[str, Any]:
    data = run(cfg, console)
    spec = FabricSpec.resolve(cfg.fabric)
    ip_of = lambda host: spec.host_ip(host) if host else None  # noqa: E731
    j = join(data, ip_of)
    fid = fidelity(data, j, data.lone_flow_ratio)
    summary = summarize(data, j, fid, ip_of)
    summary["decision_replay"] = replay_checks(data.decisions, spec, cfg)
    out = Path(cfg.out)
    write_trace(out / "trace.jsonl", data, j, spec)
    trace = read_trace(out / "trace.jsonl")  # validated on read too
    to_simai_csv(trace, out / "flows_simai.csv")
    to_fct_txt(trace, out / "fct.txt")
    to_request_metrics_csv(trace, out / "request_metrics.csv")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    collected = ("decisions", "lanes_known", "flow_bytes", "link_bytes", "port_drops", "tcp_retrans", "cpu_idle",
                 "lone_flow_ratio", "lone_flow_tries", "config")
    (out / "collected.json").write_text(json.dumps({k: getattr(data, k) for k in collected}, indent=1))
    return summary


def replay_checks(decisions: list[dict[str, Any]], spec: FabricSpec, cfg: RunConfig) -> list[dict[str, Any]]:
    """The run's decision log replayed through the reservation code: in the run's own
    mode (it must reproduce every decision), and cc as dc with zero delay and back."""
    if not decisions:
        return []
    modes = [(cfg.mode, cfg.dc_delay_s)]
    if cfg.mode == "cc":
        modes.append(("dc", 0.0))
    elif cfg.mode == "dc" and cfg.dc_delay_s == 0:
        modes.append(("cc", 0.0))
    try:
        return [replay(decisions, spec, m, delay, cfg.cc_metric).to_dict() for m, delay in modes]
    except ReplayError as e:
        logger.warning("decision log not replayable: %s", e)
        return []


def write_trace(path: Path, data: RunData, j: Joined, spec: FabricSpec) -> None:
    t0 = data.started

    def rel(x: float | None) -> float | None:
        return None if x is None else x - t0

    header = Header(t0_unix=t0, mode=data.config["mode"], fabric=spec.to_dict(), scale_b=data.config["scale_b"],
                    scale_s=data.config["scale_s"], link_mbit=data.link_mbit, host_link_mbit=data.host_link_mbit,
                    meta={META_POOLS: data.config["pools"], "workload": data.config["workload"], "qps": data.config["qps"],
                          "seed": data.config["seed"], "engine": data.config["engine"], "connector": data.config["connector"],
                          "netns_prefix": data.prefix, META_BURST: data.burst_bytes,
                          META_QUEUE: data.queue_bytes, META_DROPS: sum(data.port_drops.values()),
                          META_RETRANS: sum(data.tcp_retrans.values())})
    with TraceWriter(path, header) as w:
        for r in j.requests:
            ft = (FiveTuple(r["src_ip"], r["dst_ip"], r["src_port"], r["dst_port"] or 0)
                  if r.get("src_ip") and r.get("dst_ip") and r.get("src_port") else None)
            ttft = r.get("ttft")
            w.write(RequestRecord(
                request_id=r["request_id"], arrival_s=rel(r["arrival"]), prompt_tokens=r["prompt_tokens"],
                output_tokens=r["output_tokens"], status=r["status"], p_instance=r.get("p_host"),
                d_instance=r.get("d_host"), p_arrival_s=rel(r.get("p_arrival")),
                prefill_start_s=rel(r.get("prefill_start")),
                prefill_end_s=rel(r.get("prefill_end")), kv_bytes=r.get("kv_bytes"),
                push_start_s=rel(r.get("push_start")), push_end_s=rel(r.get("push_end")), lane=r.get("lane"),
                five_tuple=ft, path_predicted=r.get("path_predicted"), path_measured=r.get("path_measured"),
                decode_start_s=rel(r.get("decode_start")), first_token_s=rel(r.get("first_token")),
                completion_s=rel(r.get("completion")),
                ttft_s=None if ttft is None else rel(r["first_token"]) - rel(r["arrival"]),
                tpot_s=r.get("tpot"), recomputed=r["recomputed"]))
        for f in j.flows:
            w.write(FlowRecord(flow_id=f["flow_id"], request_id=f["request_id"],
                               five_tuple=FiveTuple(f["src_ip"], f["dst_ip"], f["src_port"], f["dst_port"] or 0),
                               bytes=f["bytes"], start_s=rel(f["start"]), end_s=rel(f["end"]), path=f["path"],
                               standalone_fct_s=f["standalone_fct"], lane=f["lane"],
                               path_predicted=f["path_predicted"]))


def _fmt(st: dict[str, Any], key: str, ms: bool = True) -> str:
    v = st[key]
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if ms else f"{v:.2f}"


def print_summaries(summaries: list[dict[str, Any]], console: Console) -> None:
    for unit in ("testbed", "datacenter"):
        if not all(unit in s for s in summaries):
            continue
        t = Table(title=f"per mode, {unit} time (ms)")
        for c in ("mode", "ok/all", "FCT mean", "FCT p99", "slowdown mean", "slowdown p50", "slowdown p99", "TTFT mean", "TTFT p99",
                  "TPOT mean", "path agreement", "fidelity"):
            t.add_column(c)
        for s in summaries:
            u = s[unit]
            agree = "-" if s["path_agreement"] is None else f"{100 * s['path_agreement']:.0f}% of {s['pushes_with_path']}"
            fid = "valid" if s["fidelity"]["valid"] else "[red]INVALID[/red]: " + "; ".join(s["fidelity"]["problems"])
            t.add_row(s["mode"], f"{s['ok']}/{s['requests']}", _fmt(u["fct_s"], "mean"), _fmt(u["fct_s"], "p99"),
                      _fmt(u["slowdown"], "mean", False), _fmt(u["slowdown"], "p50", False), _fmt(u["slowdown"], "p99", False), _fmt(u["ttft_s"], "mean"),
                      _fmt(u["ttft_s"], "p99"), _fmt(u["tpot_s"], "mean"), agree, fid)
        console.print(t)


def run_modes(cfgs: list[RunConfig], out: str, console: Console) -> int:
    summaries = []
    for cfg in cfgs:
        console.rule(f"mode {cfg.mode}")
        summaries.append(run_one(cfg, console))
    Path(out).mkdir(parents=True, exist_ok=True)
    traces = {cfg.mode: read_trace(Path(cfg.out) / "trace.jsonl") for cfg in cfgs}
    (Path(out) / "summary.json").write_text(json.dumps(summaries, indent=1))
    print_summaries(summaries, console)
    fig = compare_modes(traces, Path(out) / "modes.png")
    if fig is not None:
        console.print(f"figure: {fig}")
    for s in summaries:
        for r in s.get("decision_replay", []):
            console.print(f"{s['mode']}: its {r['decisions']} reservations replayed as {r['mode']}"
                          f"{' (delay %g s)' % r['dc_delay_s'] if r['mode'] == 'dc' else ''}: "
                          f"{r['same_lane']} same lane")
        if s["decode_only"] is not None:
            dc = s["decode_only"]
            console.print(f"{s['mode']}: {dc['equal']} of {dc['checked']} completions equal the decode-only output"
                          + ("" if dc.get("required", True) else " (not required: P and D decode at unequal TP sizes)"))

    def good(s: dict[str, Any]) -> bool:
        dc = s["decode_only"]
        same = dc is None or not dc.get("required", True) or dc["equal"] == dc["checked"]
        return s["fidelity"]["valid"] and s["failed"] == 0 and same

    return 0 if all(good(s) for s in summaries) else 1
