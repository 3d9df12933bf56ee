"""The demo's steps: each variant measured on the testbed, each trace replayed in the
bridge (raw and calibrated), and, where no fabric can be built, the simulation alone."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from kvpath.demo.profiles import Profile, Variant
from kvpath.demo.rows import Row, replay_rows, simulated_rows
from kvpath.trace import Trace, read_trace

logger = logging.getLogger(__name__)


@dataclass
class Measured:
    """A variant's testbed run: its trace and the run's summary (``summary.json``)."""

    variant: Variant
    trace: Trace
    summary: dict

    @property
    def scale(self) -> float:
        return float(self.summary["time_scale_testbed_per_dc"])

    @property
    def verdict(self) -> str:
        """valid or INVALID (the run's fidelity checks), and how many requests failed."""
        bad = self.summary["failed"]
        text = "valid" if self.summary["fidelity"]["valid"] else "INVALID"
        return text if not bad else f"{text}, {bad} failed"

    @property
    def problems(self) -> list[str]:
        return list(self.summary["fidelity"]["problems"])


@dataclass
class Replays:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_config(profile: Profile, variant: Variant, out: Path):
    """The testbed run of one variant (``kvpath testbed run``'s configuration), validated."""
    from kvpath.testbed.run_config import RunConfig

    cfg = RunConfig(out=str(out / variant.label), fabric=profile.fabric, pools=profile.pools, engine="emulated",
                    workload=profile.workload, qps=profile.qps, requests=profile.requests, mode=variant.mode,
                    seed=profile.seed, scale_b=profile.scale_b, scale_s=profile.scale_s,
                    max_output=profile.max_output, policy=variant.policy)
    cfg.validate()
    return cfg


def measure(profile: Profile, out: Path, console: Console) -> list[Measured]:
    """Each variant on the emulated fabric, one after another (same workload and seed)."""
    from kvpath.testbed.run_session import run_one

    done = []
    for i, v in enumerate(profile.variants, 1):
        console.rule(f"[{i}/{len(profile.variants)}] testbed: {v.label} (mode {v.mode}, policy {v.policy})")
        cfg = run_config(profile, v, out)
        summary = run_one(cfg, console)
        done.append(Measured(v, read_trace(Path(cfg.out) / "trace.jsonl"), summary))
    return done


def replay(measured: list[Measured], backends: list[str], console: Console) -> Replays:
    """Each trace through each backend with the trace's own constants, and through the flow
    model calibrated on the first variant's trace (fit on its first half)."""
    from kvpath.bridge.calibrate import calibrate
    from kvpath.bridge.compare import header_net_params, replay_trace
    from kvpath.trace_header import TraceSetup

    res = Replays()
    if not measured:
        return res
    base = measured[0]
    console.rule(f"bridge: calibrating the flow model on {base.variant.label}'s trace (first half)")
    try:
        cal = calibrate(base.trace, "flow", train_frac=0.5)
        res.notes.append(
            f"flow, cal.: the flow model with the network and compute constants fitted on the first half of "
            f"{base.variant.label}'s trace, applied to every variant; on {base.variant.label}'s other half the "
            f"FCT mean error went "
            f"{cal.fct.before.mean:+.0%} -> {cal.fct.after.mean:+.0%}, TTFT {cal.ttft.before.mean:+.0%} -> "
            f"{cal.ttft.after.mean:+.0%}, TPOT {cal.tpot.before.mean:+.0%} -> {cal.tpot.after.mean:+.0%}")
    except Exception as e:  # a trace too small or odd to fit: the raw replays still count
        cal = None
        res.notes.append(f"no calibration: {e}")
    for m in measured:
        console.rule(f"bridge: replaying {m.variant.label} through {', '.join(backends)}")
        params = header_net_params(TraceSetup(m.trace))
        reps: list[tuple[str, object]] = []
        runs = [(b, b, params, None) for b in backends]
        if cal is not None:
            runs.insert(1, ("flow, cal.", "flow", cal.net, cal.compute))
        for source, b, net, compute in runs:
            try:
                reps.append((source, replay_trace(m.trace, b, net, compute=compute)))
            except Exception as e:  # no flows, ns-3 missing or failed: the others still count
                res.notes.append(f"{m.variant.label}: {source} replay failed: {e}")
                logger.warning("%s: %s replay failed: %s", m.variant.label, source, e)
        res.notes.extend(f"{m.variant.label}: fidelity: {p}" for p in m.problems)
        if reps:
            res.rows.extend(replay_rows(m.variant.label, reps, m.scale, m.verdict))
    return res


def simulate_only(profile: Profile, out: Path, console: Console) -> Replays:
    """No fabric here: the same workload in the serving simulation alone (flow backend,
    datacenter time). Its policy is round robin, so only the round-robin variants run."""
    from kvpath.bridge.serving_sim import ServingConfig, simulate
    from kvpath.deployment import parse_pools
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.fabric import FabricSpec
    from kvpath.trace import TraceWriter
    from kvpath.trace_metrics import TraceMetrics
    from kvpath.workloads import load_workload

    res = Replays()
    variants = [v for v in profile.variants if v.policy == "round_robin"]
    skipped = [v.label for v in profile.variants if v.policy != "round_robin"]
    if skipped:
        res.notes.append(f"not simulated: {', '.join(skipped)} (the serving simulation places round robin only)")
    cfg = run_config(profile, variants[0], out)
    spec = FabricSpec.resolve(profile.fabric)
    itm = IterationTimeModel.preset(cfg.model, cfg.accelerator)
    w = load_workload(profile.workload, n=profile.requests, qps=profile.qps, seed=profile.seed,
                      min_prompt=cfg.min_prompt, max_prompt=cfg.max_prompt,
                      pd_ratio=cfg.pd_ratio).limit_tokens(max_output=profile.max_output)
    for i, v in enumerate(variants, 1):
        console.rule(f"[{i}/{len(variants)}] simulation: {v.label} (mode {v.mode}, flow backend)")
        trace, _ = simulate(spec, list(w.requests), ServingConfig(pools=parse_pools(profile.pools), mode=v.mode,
                                                                  backend="flow"), itm)
        path = out / v.label / "trace.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with TraceWriter(path, trace.header) as tw:
            tw.write_all([*trace.requests, *trace.flows])
        res.rows.append(simulated_rows(v.label, "flow (simulated only)", TraceMetrics.of(trace)))
    return res


def write_json(path: Path, rows: list[Row], notes: list[str], measured: bool) -> None:
    from kvpath.demo.rows import to_dicts

    tmp = path.with_name(path.name + ".tmp")  # an interrupted write leaves no half a file
    tmp.write_text(json.dumps({"measured": measured, "rows": to_dicts(rows), "notes": notes}, indent=1,
                              allow_nan=False))
    tmp.replace(path)
