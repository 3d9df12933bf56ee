"""Joins what a testbed run collected (client, engines, connector transfers, reservation
decisions, spine counters) into per-request and per-flow rows, checks the run's
fidelity, and summarises it."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpath.request_timeline import part_lengths

from kvpath.testbed.orchestrator import RunData


@dataclass
class Joined:
    requests: list[dict[str, Any]] = field(default_factory=list)
    flows: list[dict[str, Any]] = field(default_factory=list)
    lanes: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (P ip, D ip, sport) -> dport
    overhead_s: float = 0.0  # the fixed cost of a push on an idle fabric (calibrate_standalone)
    lone_flows: int = 0  # pushes no other push overlapped


def _lane_dports(data: RunData, ip_of: Any) -> dict[tuple[str, str, int], int]:
    out = {}
    for pair, workers in data.lanes_known.items():
        src, dst = pair.split("->")
        for lanes in workers.values():
            for _lane, sport, dport in lanes:
                out[(ip_of(src), ip_of(dst), int(sport))] = int(dport)
    return out


def _pair_ranks(worker: str) -> tuple[int, int] | None:
    """(P rank, D rank) of a decision's worker pair, ``"p-eng/r0>d-eng/r1"``."""
    try:
        p, d = worker.split(">")
        return int(p.rpartition("/r")[2]), int(d.rpartition("/r")[2])
    except ValueError:
        return None


def _predicted_spine(dec: dict[str, Any], rank: int, peer_rank: int) -> str | None:
    """The spine the decision reserved for the flow of one rank pair: a request's flows
    are reserved together, one spine per worker pair (``workers``/``spines``)."""
    for w, spine in zip(dec.get("workers") or [], dec.get("spines") or []):
        if _pair_ranks(w) == (rank, peer_rank):
            return spine
    return dec.get("spine")


def join(data: RunData, ip_of: Any) -> Joined:
    """One row per request; one flow per push, i.e. per (P rank, D rank) pair of a
    request (one at TP=1), each with its own lane, measured spine and reserved spine."""
    j = Joined(lanes=_lane_dports(data, ip_of))
    p_rec: dict[str, dict] = {}
    d_rec: dict[str, dict] = {}
    for host, rec in data.engine_records.items():
        for r in rec["records"]:
            if r.get("transfer_id"):
                (p_rec if rec["role"] == "prefill" else d_rec)[r["transfer_id"]] = dict(r, host=host)
    transfers: dict[str, list[Any]] = {}
    for t in data.transfers:
        transfers.setdefault(t.record.transfer_id, []).append(t)
    # (a placement that found no lane reserved nothing: no reservation to use or leave unused)
    decisions = {d["transfer_id"]: d for d in data.decisions if not d.get("fallback")}
    counts = {tuple(json.loads(k).values()): v for k, v in data.flow_bytes.items()}
    by_tuple_prefix: dict[tuple[str, str, int], dict[str, int]] = {}
    for (sip, dip, sport, _dport, _proto), per in counts.items():
        agg = by_tuple_prefix.setdefault((sip, dip, int(sport)), {})
        for spine, b in per.items():
            agg[spine] = agg.get(spine, 0) + b
    # with one P and one D there is no doubt where a request ran, even when no engine said so
    # (vLLM's in-tree connector keeps no per-request record)
    only_p = data.p_hosts[0] if len(data.p_hosts) == 1 else None
    only_d = data.d_hosts[0] if len(data.d_hosts) == 1 else None
    for c in data.client:
        tid = c.get("transfer_id", "")
        p, d, dec = p_rec.get(tid, {}), d_rec.get(tid, {}), decisions.get(tid)
        pushes = sorted(transfers.get(tid, []), key=lambda t: (t.record.rank, t.record.peer_rank))
        if c["status"] == "ok":
            p, d = {"host": only_p, **p}, {"host": only_d, **d}
        row: dict[str, Any] = {
            "request_id": c["request_id"], "transfer_id": tid, "status": c["status"],
            "arrival": c["arrival"], "prompt_tokens": c["prompt_tokens"], "output_tokens": c["tokens"],
            "p_host": p.get("host"), "d_host": d.get("host"), "prefill_start": p.get("prefill_start"),
            "prefill_end": p.get("prefill_end"), "kv_ready": d.get("kv_ready"), "decode_start": d.get("decode_start"),
            "first_token": c.get("first_token"), "completion": c.get("completion"),
            "recomputed": bool(d.get("recomputed")),
        }
        if p.get("arrival") is not None:  # emulated P engines note when their server got it
            row["p_arrival"], row["front_end"] = p["arrival"], p["arrival"] - c["arrival"]
        if row["first_token"] is not None:
            row["ttft"] = row["first_token"] - row["arrival"]
            n = c["tokens"]
            row["tpot"] = (row["completion"] - row["first_token"]) / (n - 1) if n > 1 else None
        flows = []
        for push in pushes:
            t = push.record
            p_ip, d_ip = ip_of(p.get("host") or push.p_host), ip_of(d.get("host")) if d.get("host") else None
            sport = int(t.src_port or 0)
            measured = by_tuple_prefix.get((p_ip, d_ip, sport), {}) if d_ip else {}
            # a push that did not wait for its reservation (reserve_at=push answered late)
            # went on the hash's lane: the reservation's spine is not its prediction
            used = dec is not None and dec.get("lane") == t.lane
            flows.append({
                "flow_id": tid if len(pushes) == 1 else f"{tid}/r{t.rank}>r{t.peer_rank}",
                "request_id": c["request_id"], "src_ip": p_ip, "dst_ip": d_ip, "src_port": sport,
                "dst_port": j.lanes.get((p_ip, d_ip, sport)), "bytes": t.bytes, "start": t.submit_at,
                "end": push.end, "status": t.status, "lane": t.lane, "layered": t.layers > 0,
                "path": max(measured.items(), key=lambda kv: kv[1])[0] if measured else None,
                "path_predicted": _predicted_spine(dec, t.rank, t.peer_rank) if used else None, "used": used})
        if flows:
            first = flows[0]
            bad = [f["status"] for f in flows if f["status"] != "ok"]
            ends = [f["end"] for f in flows]
            # the request's push: all its flows, from the first start to the last end
            row.update({"kv_bytes": sum(f["bytes"] for f in flows),
                        "push_start": min((f["start"] for f in flows if f["start"]), default=None),
                        "push_end": None if None in ends else max(ends),
                        "push_status": bad[0] if bad else "ok", "flows": len(flows), "lane": first["lane"],
                        "src_ip": first["src_ip"], "dst_ip": first["dst_ip"], "src_port": first["src_port"],
                        "dst_port": first["dst_port"], "path_predicted": first["path_predicted"],
                        "path_measured": first["path"],
                        "paths": [(f["path_predicted"], f["path"]) for f in flows],
                        "reserved_lane": dec.get("lane") if dec else None,
                        "reservation_unused": dec is not None and not all(f["used"] for f in flows)})
        for f in flows:
            if f["start"] and f["end"] and f["status"] == "ok":
                fct = f["end"] - f["start"]
                # pushes cross the spines (pd_placement): the slower tier is the bottleneck
                standalone = standalone_fct(f["bytes"], min(data.link_mbit, data.host_link_mbit or data.link_mbit),
                                            data.burst_bytes)
                j.flows.append({k: f[k] for k in ("flow_id", "request_id", "src_ip", "dst_ip", "src_port", "dst_port",
                                                  "bytes", "start", "end", "path", "lane", "path_predicted",
                                                  "layered")}
                               | {"fct": fct, "wire_fct": standalone,
                                  "wire_slowdown": fct / standalone if standalone else None})
        j.requests.append(row)
    j.overhead_s, j.lone_flows = calibrate_standalone(j.flows)
    return j


def calibrate_standalone(flows: list[dict[str, Any]], min_lone: int = 5) -> tuple[float, int]:
    """Add the transfer engine's fixed cost per push to every flow's standalone FCT.

    The wire time alone (``standalone_fct``) leaves out what a push costs even on an
    idle fabric: posting the WRITE, UCX, D noticing the notification. The pushes that had
    the whole fabric to themselves (no other push overlapped them) measure it: their
    median FCT minus wire time. With fewer than ``min_lone`` of them it stays 0. A
    layer-wise push (``layered``) spans the prefill it overlaps, so it never measures it.
    Returns (overhead seconds, lone pushes)."""
    lone = [f for f in flows if not f.get("layered")
            and not any(g is not f and g["start"] < f["end"] and f["start"] < g["end"] for g in flows)]
    overhead = float(np.median([f["fct"] - f["wire_fct"] for f in lone])) if len(lone) >= min_lone else 0.0
    overhead = max(overhead, 0.0)
    for f in flows:
        f["standalone_fct"] = f["wire_fct"] + overhead
        f["slowdown"] = f["fct"] / f["standalone_fct"] if f["standalone_fct"] > 0 else None
    return overhead, len(lone)


def standalone_fct(nbytes: int, link_mbit: float, burst_bytes: int) -> float:
    """A flow's FCT alone on its path: tbf lets the first ``burst`` bytes through at once,
    the rest at the link rate."""
    return max(nbytes - burst_bytes, 0) * 8 / (link_mbit * 1e6)


# The parts of a P/D request's TTFT, in order: (name, start field, end field) of a joined row
TTFT_PARTS = (("front end", "arrival", "p_arrival"), ("P queue", "p_arrival", "prefill_start"),
              ("P prefill", "prefill_start", "prefill_end"), ("wait for D", "prefill_end", "push_start"),
              ("push", "push_start", "push_end"), ("D to 1st token", "push_end", "first_token"))


def ttft_breakdown(rows: list[dict[str, Any]], scale: float = 1.0, how: str = "median") -> dict[str, float | None]:
    """The median (or ``how="mean"``) of each TTFT part over the completed requests that
    have both its ends (seconds x ``scale``); None where no request has them (real
    engines do not tell when their server got a request). A layer-wise push counts
    from the end of P's prefill (:func:`kvpath.request_timeline.part_lengths`)."""
    chain = [TTFT_PARTS[0][1]] + [b for _, _, b in TTFT_PARTS]
    each = [part_lengths([r.get(f) for f in chain]) for r in rows]
    stat = np.median if how == "median" else np.mean
    out: dict[str, float | None] = {}
    for k, (name, _, _) in enumerate(TTFT_PARTS):
        v = [p[k] for p in each if p[k] is not None]
        out[name] = float(stat(v)) * scale if v else None
    return out


def _stats(vals: list[float], scale: float = 1.0) -> dict[str, float | None]:
    v = np.array([x for x in vals if x is not None], dtype=float) * scale
    if v.size == 0:
        return {"mean": None, "p50": None, "p99": None, "n": 0}
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "n": int(v.size)}


def fidelity(data: RunData, j: Joined, lone_flow_ratio: float | None) -> dict[str, Any]:
    """Did the machine keep up? CPU idle during the run, a lone flow's rate against the
    configured link rate, and the spines' counters against the pushes' bytes."""
    idle = data.cpu_idle
    checks: dict[str, Any] = {"cpu_idle_min": min(idle) if idle else None,
                              "cpu_idle_median": statistics.median(idle) if idle else None,
                              "lone_flow_rate_ratio": lone_flow_ratio, "lone_flow_tries": list(data.lone_flow_tries)}
    pushed = sum(f["bytes"] for f in j.flows)
    lanes_used = {(f["src_ip"], f["src_port"]) for f in j.flows}
    counted = 0
    for k, per in data.flow_bytes.items():
        ft = json.loads(k)
        if (ft["src_ip"], ft["src_port"]) in lanes_used:  # P -> D direction of a lane that carried pushes
            counted += sum(per.values())
    checks["spine_bytes_over_push_bytes"] = counted / pushed if pushed else None
    problems = []
    if idle and statistics.median(idle) < 10:
        problems.append(f"CPU idle median {statistics.median(idle):.0f}% < 10%: the machine was saturated")
    if lone_flow_ratio is not None and not 0.9 <= lone_flow_ratio <= 1.1:
        problems.append(f"a lone flow ran at {lone_flow_ratio:.2f} of the link rate (outside 0.9-1.1)")
    ratio = checks["spine_bytes_over_push_bytes"]
    # lanes also carry the connector's probes and TCP/IP headers: a few % above 1.0 is expected
    if ratio is not None and not 0.98 <= ratio <= 1.15:
        problems.append(f"spine counters saw {ratio:.3f} x the pushed bytes (outside 0.98-1.15)")
    checks["problems"] = problems
    checks["valid"] = not problems
    return checks


def spine_bytes_p_to_d(data: RunData, ip_of: Any) -> int:
    """Bytes the spines forwarded from a P host to a D host during the run: the KV
    traffic whatever moved it (the only measure of it with a pull connector)."""
    p_ips, d_ips = {ip_of(h) for h in data.p_hosts}, {ip_of(h) for h in data.d_hosts}
    total = 0
    for k, per in data.flow_bytes.items():
        ft = json.loads(k)
        if ft["src_ip"] in p_ips and ft["dst_ip"] in d_ips:
            total += sum(per.values())
    return total


def model_tpot(config: dict[str, Any], ok: list[dict[str, Any]]) -> float | None:
    """The iteration-time model's mean TPOT over the completed requests, in datacenter
    seconds: each request's decode steps alone (batch of one) at its context. Emulated
    engines sleep the same model's decode time (x B/S), so a measured TPOT far above it
    is this machine's event loop running late (``kvpath.testbed.envelope``). None with
    real engines, which run no model."""
    if config.get("engine") != "emulated":
        return None
    from kvpath.iteration_time import IterationTimeModel

    itm = IterationTimeModel.preset(config["model"], config["accelerator"])
    # a request of n tokens decodes n - 1 steps after its first token, at contexts prompt + 1 .. prompt + n - 1
    per = [float(np.mean([itm.decode_time([r["prompt_tokens"] + i]) for i in range(1, r["output_tokens"])]))
           for r in ok if (r.get("output_tokens") or 0) > 1]
    return float(np.mean(per)) if per else None


def summarize(data: RunData, j: Joined, fid: dict[str, Any], ip_of: Any) -> dict[str, Any]:
    scale = data.config["scale_b"] / data.config["scale_s"]  # testbed seconds per datacenter second
    ok = [r for r in j.requests if r["status"] == "ok"]
    pushes = [r for r in j.requests if r.get("push_status")]
    # every flow of a request (one per rank pair at TP > 1) is judged on its own
    judged = [(pred, meas) for r in pushes for pred, meas in r.get("paths", []) if pred and meas]
    agree = sum(pred == meas for pred, meas in judged)
    out: dict[str, Any] = {
        "mode": data.config["mode"], "push_granularity": data.config.get("push_granularity", "request"),
        "requests": len(j.requests), "ok": len(ok),
        "failed": len(j.requests) - len(ok),
        "failures": dict(Counter(r["status"] for r in j.requests if r["status"] != "ok")),  # status -> count
        "recomputed": sum(r["recomputed"] for r in j.requests),
        "pushes": len(pushes), "pushes_with_path": len(judged), "path_agreement": agree / len(judged) if judged else None,
        "reservations_unused": sum(bool(r.get("reservation_unused")) for r in pushes),
        "fidelity": fid, "time_scale_testbed_per_dc": scale, "engine": data.config["engine"],
        "connector": data.config["connector"], "decode_only": data.decode_only, "vllm_kv_loss": data.kv_loss,
        "kv_bytes_on_spines": spine_bytes_p_to_d(data, ip_of),
        "push_overhead_s": j.overhead_s, "lone_pushes": j.lone_flows,
        "tpot_model_s": model_tpot(data.config, ok),
    }
    # real engines run in real time: only emulated engines have a datacenter-equivalent time
    units = (("testbed", 1.0), ("datacenter", 1.0 / scale)) if data.config["engine"] == "emulated" else (("testbed", 1.0),)
    for unit, k in units:
        out[unit] = {
            "fct_s": _stats([f["fct"] for f in j.flows], k),
            "slowdown": _stats([f["slowdown"] for f in j.flows]),
            "wire_slowdown": _stats([f["wire_slowdown"] for f in j.flows]),
            "ttft_s": _stats([r.get("ttft") for r in ok], k),
            # the client's send to P's server receiving it: the client, the proxy (its
            # reservation included) and P's HTTP server, which the serving model has as
            # one fitted constant per request
            "front_end_s": _stats([r.get("front_end") for r in ok], k),
            "tpot_s": _stats([r.get("tpot") for r in ok], k),
            "ttft_breakdown_s": ttft_breakdown(ok, k),  # median per part
            "ttft_parts_mean_s": ttft_breakdown(ok, k, "mean"),
        }
    return out
