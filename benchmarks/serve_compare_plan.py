"""benchmarks/serve_compare.py's plan: its modes, the grid of each engine kind, the
interleaved sessions and the time estimate (a module the script imports, not a script)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from kvpath.reservation.wire import MODES as RESERVATION_MODES


ENGINES = ("vllm", "emulated")
IN_TREE = {"nixl-pull": "nixl", "nixl-push": "nixl-push"}  # mode -> the testbed's --connector
DEFAULT_MODES = ("nixl-pull", "nixl-push", "kvpath-ecmp", "kvpath-cc", "kvpath-joint")
# kvpath modes that also name the proxy's policy: P, D and the lane placed together by the
# reservation service (cc), docs/placement.md
PLACED = {"kvpath-joint": ("cc", "joint")}

# What each engine kind runs on, and its default grid. vLLM engines: the tiny model's
# context is 2048 tokens (prompt + output), one core each, 200 Mbit/s links. Emulated:
# LLaMA-3-8B prompts, the testbed's 8P8D comparison setting (docs/results.md, section 10).
SETUPS: dict[str, dict[str, Any]] = {
    "vllm": {"fabric": "small", "pools": "1P1D", "scale_b": 500.0, "scale_s": 1.0, "policy": "round_robin",
             "input_lens": (256, 1024), "output_lens": (32,), "rates": (1.0, 2.0), "prompts": 12},
    "emulated": {"fabric": "rack4", "pools": "8P8D", "scale_b": 1000.0, "scale_s": 250.0,
                 "policy": "least_outstanding", "input_lens": (1024, 2048), "output_lens": (32,),
                 "rates": (10.0, 20.0), "prompts": 120},
}

# The time model of the estimate (seconds, measured here; benchmarks/README.md):
SETUP_S = {"vllm": 70.0, "emulated": 75.0}  # fabric, lone flow, engines up, warm-up, teardown
# `vllm bench serve` from its start to its first request (tokenizer, prompts; a fresh
# process also imports vLLM, which the in-tree connectors' spinning progress threads
# stretch from about 18 s to over a minute), by (bench client, in-tree mode)
BENCH_START_S = {("cli", False): 18.0, ("cli", True): 75.0, ("shared", False): 3.0, ("shared", True): 8.0}
DRAIN_S = {"vllm": 8.0, "emulated": 4.0}  # after the last arrival: the last answers, counters, logs
IN_TREE_DRAIN_S = 15.0  # more with an in-tree connector: its TTFTs are seconds here
BENCH_CLIENTS = ("shared", "cli")


def connector_and_mode(mode: str) -> tuple[str, str]:
    """A comparison mode's testbed ``--connector`` and reservation ``--mode``."""
    if mode in IN_TREE:
        return IN_TREE[mode], "ecmp"
    if mode in PLACED:
        return "kvpath", PLACED[mode][0]
    if mode.startswith("kvpath-") and mode.removeprefix("kvpath-") in RESERVATION_MODES:
        return "kvpath", mode.removeprefix("kvpath-")
    raise ValueError(f"unknown mode {mode!r}: use {', '.join(IN_TREE)}, "
                     f"{', '.join('kvpath-' + m for m in RESERVATION_MODES)} or {', '.join(PLACED)}")


def mode_policy(mode: str, default: str) -> str:
    """The proxy's policy for a comparison mode: its own (kvpath-joint), else the setup's."""
    return PLACED[mode][1] if mode in PLACED else default


# -- the grid ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    input_len: int
    output_len: int
    rate: float  # requests/s (Poisson arrivals)


@dataclass(frozen=True)
class Setup:
    """One engine kind, the fabric it runs on, its modes and grid."""

    engine: str
    fabric: str
    pools: str
    scale_b: float
    scale_s: float
    policy: str
    modes: tuple[str, ...]
    points: tuple[Point, ...]
    prompts: int


@dataclass(frozen=True)
class Session:
    """One mode's engines up for one round: every grid point once."""

    round: int  # 1-based
    setup: Setup
    mode: str

    @property
    def name(self) -> str:
        return f"{self.setup.engine}/r{self.round}-{self.mode}"


def build_points(input_lens: Iterable[int], output_lens: Iterable[int], rates: Iterable[float]) -> tuple[Point, ...]:
    return tuple(Point(i, o, float(r)) for i, o, r in itertools.product(input_lens, output_lens, rates))


def build_setup(engine: str, modes: Sequence[str], input_lens: Sequence[int] | None = None,
                output_lens: Sequence[int] | None = None, rates: Sequence[float] | None = None,
                prompts: int | None = None) -> Setup:
    """The setup of ``engine`` with its defaults where a value is None. Emulated engines
    keep the kvpath modes only; vLLM engines (one P, one D) all but the placed ones."""
    d = SETUPS[engine]
    for m in modes:
        connector_and_mode(m)  # a bad name is an error here, before anything starts
    # emulated engines run the kvpath modes only; vLLM's 1P1D has nothing to place (one P, one D)
    kept = tuple(m for m in modes if (engine == "vllm" and m not in PLACED) or (engine != "vllm" and m not in IN_TREE))
    return Setup(engine, d["fabric"], d["pools"], d["scale_b"], d["scale_s"], d["policy"], kept,
                 build_points(input_lens or d["input_lens"], output_lens or d["output_lens"], rates or d["rates"]),
                 prompts or d["prompts"])


def sessions(setups: Sequence[Setup], rounds: int) -> list[Session]:
    """Interleaved: round 1 runs every mode of every setup once (all grid points), then round 2."""
    return [Session(r, s, m) for r in range(1, rounds + 1) for s in setups for m in s.modes]


def point_estimate_s(engine: str, mode: str, point: Point, prompts: int, client: str = "shared") -> float:
    in_tree = mode in IN_TREE
    return (BENCH_START_S[client, in_tree] + prompts / point.rate
            + (IN_TREE_DRAIN_S if in_tree else DRAIN_S[engine]))


def session_estimate_s(setup: Setup, mode: str, client: str = "shared") -> float:
    return SETUP_S[setup.engine] + sum(point_estimate_s(setup.engine, mode, p, setup.prompts, client)
                                       for p in setup.points)


def estimate_s(plan: Sequence[Session], client: str = "shared") -> float:
    return sum(session_estimate_s(s.setup, s.mode, client) for s in plan)


def describe_plan(plan: Sequence[Session], rounds: int, client: str = "shared") -> list[str]:
    """What will run and how long it should take, one line each."""
    lines = []
    for setup in dict.fromkeys(s.setup for s in plan):
        pts = setup.points
        per_mode = ", ".join(f"{m} {session_estimate_s(setup, m, client) / 60:.1f}" for m in setup.modes)
        lines.append(
            f"{setup.engine}: {setup.pools} on {setup.fabric} (links / {setup.scale_b:g}"
            + (f", KV / {setup.scale_s:g}" if setup.engine == "emulated" else "") + f", {setup.policy}); "
            f"modes {', '.join(setup.modes) or '(none)'}; input lens {sorted({p.input_len for p in pts})}, "
            f"output lens {sorted({p.output_len for p in pts})}, rates {sorted({p.rate for p in pts})} req/s; "
            f"{setup.prompts} prompts per point; {len(pts)} points x {len(setup.modes)} modes x {rounds} rounds; "
            f"minutes per mode and round: {per_mode}")
    total = estimate_s(plan, client)
    lines.append(f"{len(plan)} engine start-ups, {sum(len(s.setup.points) for s in plan)} bench runs "
                 f"({client} bench client): estimated {total / 60:.0f} min ({total:.0f} s)"
                 + ("" if total <= 3600 else " -- over an hour: fewer points, prompts or rounds"))
    return lines
