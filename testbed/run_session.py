"""Runs one or more modes of a testbed run one after another (same workload, same
seed), repeated and rotated when asked, judges each run by the fidelity envelope,
writes each run's rows and summary, and prints the modes side by side."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from kvpath.fabric import FabricSpec
from kvpath.reservation.replay import ReplayError, replay
from kvpath.testbed import envelope
from kvpath.testbed.orchestrator import RunData, run
from kvpath.testbed.plots import compare_modes
from kvpath.testbed.repeats import aggregate, rotation, run_dir
from kvpath.testbed.run_config import RunConfig
from kvpath.testbed.run_report import Joined, fidelity, join, summarize
from kvpath.testbed.run_table import print_summaries
from kvpath.trace import FiveTuple, FlowRecord, Header, RequestRecord, TraceWriter, read_trace
from kvpath.trace.formats import to_fct_txt, to_request_metrics_csv, to_simai_csv
from kvpath.trace.header import META_BURST, META_DROPS, META_POOLS, META_QUEUE, META_RETRANS

logger = logging.getLogger(__name__)


def run_one(cfg: RunConfig, console: Console) -> dict[str, Any]:
    data = run(cfg, console)
    spec = FabricSpec.resolve(cfg.fabric)
    ip_of = lambda host: spec.host_ip(host) if host else None  # noqa: E731
    j = join(data, ip_of)
    fid = fidelity(data, j, data.lone_flow_ratio)
    summary = summarize(data, j, fid, ip_of)
    summary["decision_replay"] = replay_checks(data, spec, cfg)
    out = Path(cfg.out)
    write_trace(out / "trace.jsonl", data, j, spec)
    trace = read_trace(out / "trace.jsonl")  # validated on read too
    to_simai_csv(trace, out / "flows_simai.csv")
    to_fct_txt(trace, out / "fct.txt")
    to_request_metrics_csv(trace, out / "request_metrics.csv")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    collected = ("decisions", "lanes_known", "lane_log", "lanes_complete_from_seq", "cost_model", "flow_bytes", "link_bytes", "port_drops", "tcp_retrans", "cpu_idle",
                 "lone_flow_ratio", "lone_flow_tries", "config")
    (out / "collected.json").write_text(json.dumps({k: getattr(data, k) for k in collected}, indent=1))
    return summary


def replay_checks(data: RunData, spec: FabricSpec, cfg: RunConfig) -> list[dict[str, Any]]:
    """The run's decision log replayed through the reservation code: in the run's own
    mode (it must reproduce every decision and placement), and cc as dc with zero delay
    and back."""
    if not data.decisions:
        return []
    modes = [(cfg.mode, cfg.dc_delay_s)]
    if cfg.mode == "cc":
        modes.append(("dc", 0.0))
    elif cfg.mode == "dc" and cfg.dc_delay_s == 0:
        modes.append(("cc", 0.0))
    try:
        return [replay(data.decisions, spec, m, delay, cfg.cc_metric, data.lane_log, data.cost_model,
                       data.lanes_complete_from_seq).to_dict()
                for m, delay in modes]
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
                          META_RETRANS: sum(data.tcp_retrans.values()),
                          "push_granularity": data.config.get("push_granularity", "request"),
                          "layer_group": data.config.get("layer_group", 4)})
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


@dataclass
class Run:
    """One run of a rotated schedule: its label (mode or variant), repeat number, config
    and summary."""

    label: str
    repeat: int
    cfg: RunConfig
    summary: dict[str, Any]


def run_rotated(cfgs: Sequence[tuple[str, RunConfig]], repeats: int, console: Console) -> list[Run]:
    """Each (label, config) ``repeats`` times, rotated per repeat (A B C, B C A, ...), each
    in its own folder (``repeats.run_dir``); then every run judged by the envelope
    against the others, and its ``summary.json`` rewritten with that verdict."""
    runs: list[Run] = []
    schedule = rotation(list(cfgs), repeats)
    for k, (r, (label, cfg)) in enumerate(schedule, 1):
        cfg = dataclasses.replace(cfg, out=str(run_dir(Path(cfg.out).parent, label, r, repeats))
                                  if repeats > 1 else cfg.out)
        rep = f", repeat {r}/{repeats}" if repeats > 1 else ""
        console.rule(f"[{k}/{len(schedule)}] {label} (mode {cfg.mode}, policy {cfg.policy}{rep})")
        runs.append(Run(label, r, cfg, run_one(cfg, console)))
    envelope.apply([x.summary for x in runs])
    for x in runs:
        x.summary["repeat"] = x.repeat
        x.summary["label"] = x.label  # the variant: mode, granularity, placement, push order
        x.summary.setdefault("policy", x.cfg.policy)
        (Path(x.cfg.out) / "summary.json").write_text(json.dumps(x.summary, indent=1))
    return runs


def run_modes(cfgs: list[RunConfig], out: str, console: Console, repeats: int = 1, wide: bool = False) -> int:
    runs = run_rotated([(c.label, c) for c in cfgs], repeats, console)
    Path(out).mkdir(parents=True, exist_ok=True)
    by_mode = {c.label: [x.summary for x in runs if x.label == c.label] for c in cfgs}
    # a figure of one trace per mode: its first valid repeat (the first if none is)
    firsts = {m: next((x for x in runs if x.label == m and x.summary["fidelity"]["valid"]),
                      next(x for x in runs if x.label == m)) for m in by_mode}
    traces = {m: read_trace(Path(x.cfg.out) / "trace.jsonl") for m, x in firsts.items()}
    doc = {"repeats": repeats, "runs": [x.summary for x in runs],
           "modes": {m: {u: {k: v.to_dict() for k, v in aggregate(ss, u).items()}
                         for u in ("testbed", "datacenter") if all(u in s for s in ss)} for m, ss in by_mode.items()}}
    (Path(out) / "summary.json").write_text(json.dumps(doc, indent=1))
    print_summaries(by_mode, console, wide)
    fig = compare_modes(traces, Path(out) / "modes.png")
    if fig is not None:
        console.print(f"figure: {fig}")
    for x in runs:
        s = x.summary
        name = x.label if repeats == 1 else f"{x.label} r{x.repeat}"
        for r in s.get("decision_replay", []):
            console.print(f"{name}: its {r['decisions']} reservations replayed as {r['mode']}"
                          f"{' (delay %g s)' % r['dc_delay_s'] if r['mode'] == 'dc' else ''}: "
                          f"{r['same_lane']} same lane"
                          + (f", {r['same_placement']} of {r['placements']} placements the same P, D and lane"
                             if r.get("placements") else "")
                          + (f" ({r['placements_unverified']} placements older than the lane log, on their logged "
                             f"lanes)" if r.get("placements_unverified") else ""))
        if s["decode_only"] is not None:
            dc = s["decode_only"]
            console.print(f"{name}: {dc['equal']} of {dc['checked']} completions equal the decode-only output"
                          + ("" if dc.get("required", True) else " (not required: P and D decode at unequal TP sizes)"))

    def good(s: dict[str, Any]) -> bool:
        dc = s["decode_only"]
        same = dc is None or not dc.get("required", True) or dc["equal"] == dc["checked"]
        return s["fidelity"]["valid"] and s["failed"] == 0 and same

    return 0 if all(good(x.summary) for x in runs) else 1
