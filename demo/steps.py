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
    repeat: int = 1
    folder: Path | None = None  # where its trace and summary are

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
    def valid(self) -> bool:
        return bool(self.summary["fidelity"]["valid"])

    @property
    def problems(self) -> list[str]:
        return list(self.summary["fidelity"]["problems"])

    @property
    def name(self) -> str:
        """The variant, and the repeat when there were several (its folder is then r<k>)."""
        single = self.folder is None or self.folder.name == self.variant.label
        return self.variant.label if single else f"{self.variant.label} r{self.repeat}"


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


def measure(profile: Profile, out: Path, console: Console, repeats: int = 1) -> list[Measured]:
    """Each variant on the emulated fabric (same workload and seed), ``repeats`` times in
    an order rotated per repeat, each run judged by the fidelity envelope against the
    others (``kvpath.testbed.run_session.run_rotated``)."""
    from kvpath.testbed.run_session import run_rotated

    by_label = {v.label: v for v in profile.variants}
    runs = run_rotated([(v.label, run_config(profile, v, out)) for v in profile.variants], repeats, console)
    return [Measured(by_label[r.label], read_trace(Path(r.cfg.out) / "trace.jsonl"), r.summary, r.repeat,
                     Path(r.cfg.out)) for r in runs]


def calibration_base(measured: list[Measured], label: str) -> Measured | None:
    """The run the calibration is fitted on: ``label``'s first valid repeat, never one the
    fidelity checks flagged (its numbers are the machine's); None when none is valid."""
    mine = sorted((m for m in measured if m.variant.label == label), key=lambda m: m.repeat)
    return next((m for m in mine if m.valid), None)


def replay(measured: list[Measured], backends: list[str], console: Console) -> Replays:
    """Each trace through each backend with the trace's own constants, and through the flow
    model calibrated on the first variant's first valid run (fit on its first half); the
    rows of a variant's repeats combined (median and min..max over the valid ones)."""
    from kvpath.bridge.calibrate import calibrate

    from kvpath.demo.rows import combine, range_notes

    res = Replays()
    if not measured:
        return res
    label = measured[0].variant.label  # the schedule's first: the profile's first variant
    base = calibration_base(measured, label)
    cal = None
    if base is None:
        res.notes.append(f"no calibration: no run of {label} is valid, and a disturbed run is not fitted on")
    else:
        console.rule(f"bridge: calibrating the flow model on {base.name}'s trace (first half)")
        try:
            cal = calibrate(base.trace, "flow", train_frac=0.5)
            res.notes.append(
                f"flow, cal.: the flow model with the network and compute constants fitted on the first half of "
                f"{base.name}'s trace, applied to every variant; on its other half the FCT mean error went "
                f"{cal.fct.before.mean:+.0%} -> {cal.fct.after.mean:+.0%}, TTFT {cal.ttft.before.mean:+.0%} -> "
                f"{cal.ttft.after.mean:+.0%}, TPOT {cal.tpot.before.mean:+.0%} -> {cal.tpot.after.mean:+.0%}")
        except Exception as e:  # a trace too small or odd to fit: the raw replays still count
            res.notes.append(f"no calibration: {e}")
    per_variant: dict[str, list[tuple[list[Row], bool]]] = {}
    for m in measured:
        per_variant.setdefault(m.variant.label, []).append((_replay_one(m, backends, cal, res, console), m.valid))
    order = [v.label for v in dict.fromkeys(m.variant for m in sorted(measured, key=lambda m: m.repeat))]
    for v in order:
        runs = [rows for rows, _ in per_variant[v] if rows]
        valid = [ok for rows, ok in per_variant[v] if rows]
        if runs:
            res.rows.extend(combine(runs, valid))
    res.notes.extend(range_notes(res.rows))
    if all(r.runs == 1 for r in res.rows):
        res.notes.append("each variant ran once (--repeats N: medians and min..max over N rotated runs)")
    return res


def _replay_one(m: Measured, backends: list[str], cal: object, res: Replays, console: Console) -> list[Row]:
    """One run's rows: measured, each backend raw, and the flow model calibrated."""
    from kvpath.bridge.compare import header_net_params, replay_trace
    from kvpath.trace.header import TraceSetup

    console.rule(f"bridge: replaying {m.name} through {', '.join(backends)}")
    params = header_net_params(TraceSetup(m.trace))
    reps: list[tuple[str, object]] = []
    runs = [(b, b, params, None) for b in backends]
    if cal is not None:
        runs.insert(1, ("flow, cal.", "flow", cal.net, cal.compute))  # type: ignore[attr-defined]
    for source, b, net, compute in runs:
        try:
            reps.append((source, replay_trace(m.trace, b, net, compute=compute)))
        except Exception as e:  # no flows, ns-3 missing or failed: the others still count
            res.notes.append(f"{m.name}: {source} replay failed: {e}")
            logger.warning("%s: %s replay failed: %s", m.name, source, e)
    res.notes.extend(f"{m.name}: INVALID: {p}" for p in m.problems)
    return replay_rows(m.variant.label, reps, m.scale, m.verdict, m.summary["failed"]) if reps else []


def simulate_only(profile: Profile, out: Path, console: Console) -> Replays:
    """No fabric here: the same workload in the serving simulation alone (flow backend,
    datacenter time), each variant's policy by the simulation's own placement (least
    outstanding: the reservation service's ``load``)."""
    from kvpath.bridge.serving_sim import ServingConfig, placement_of, simulate
    from kvpath.deployment import parse_pools
    from kvpath.iteration_time import IterationTimeModel
    from kvpath.fabric import FabricSpec
    from kvpath.trace import TraceWriter
    from kvpath.trace.metrics import TraceMetrics
    from kvpath.workloads import load_workload

    res = Replays()
    variants = list(profile.variants)
    cfg = run_config(profile, variants[0], out)
    spec = FabricSpec.resolve(profile.fabric)
    itm = IterationTimeModel.preset(cfg.model, cfg.accelerator)
    w = load_workload(profile.workload, n=profile.requests, qps=profile.qps, seed=profile.seed,
                      min_prompt=cfg.min_prompt, max_prompt=cfg.max_prompt,
                      pd_ratio=cfg.pd_ratio).limit_tokens(max_output=profile.max_output)
    for i, v in enumerate(variants, 1):
        console.rule(f"[{i}/{len(variants)}] simulation: {v.label} (mode {v.mode}, flow backend)")
        trace, _ = simulate(spec, list(w.requests), ServingConfig(pools=parse_pools(profile.pools), mode=v.mode,
                                                                  backend="flow", placement=placement_of(v.policy)),
                            itm)
        path = out / v.label / "trace.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with TraceWriter(path, trace.header) as tw:
            tw.write_all([*trace.requests, *trace.flows])
        res.rows.append(simulated_rows(v.label, "flow (simulated only)", TraceMetrics.of(trace)))
    return res


def report_folders(measured: list[Measured]) -> dict[str, Path]:
    """Per variant, the run the report shows: its first valid repeat (its first if none is)."""
    out: dict[str, Path] = {}
    for m in sorted(measured, key=lambda m: (not m.valid, m.repeat)):
        if m.folder is not None:
            out.setdefault(m.variant.label, m.folder)
    return out


def write_json(path: Path, rows: list[Row], notes: list[str], measured: bool, repeats: int = 1) -> None:
    from kvpath.demo.rows import to_dicts

    tmp = path.with_name(path.name + ".tmp")  # an interrupted write leaves no half a file
    tmp.write_text(json.dumps({"measured": measured, "repeats": repeats, "rows": to_dicts(rows), "notes": notes},
                              indent=1, allow_nan=False))
    tmp.replace(path)
