"""P at TP=2 (ranks on cores 0 and 1) and D at TP=1 (core 1) behind the proxy, with no
``tp=`` in the proxy's pool (it learns P's TP size from P's first answer), under a
concurrent load: does every request complete, does any push end as "P silent" while P's
ranks share saturated cores, does KV usage return to 0 on both engines?

Each round sends ``--prompts`` prompts of up to ``--words`` words at ``--concurrency``
through the proxy. kv_verify samples one push in ``--verify-every`` (P sends a digest of
what it pushed, D hashes what landed; a mismatch fails the request), the KV-bytes check.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/pd_tp_load.py [--rounds 3] [--prompts 24]
        [--concurrency 8] [--words 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvpath.tiny_model import TinyModelSpec, build_tiny_model
from kvpath.tiny_model.training import TRAINED_STEPS, corpus_words
from pd_stack import Stack

logger = logging.getLogger(__name__)


def kv_usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M))


def prompts(n: int, max_words: int, seed: int) -> list[str]:
    words = sorted(corpus_words())
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(max_words // 4, max_words))) for _ in range(n)]


async def one_round(url: str, texts: list[str], concurrency: int, max_tokens: int) -> list[tuple[int, str]]:
    """(status, text or error) per prompt."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as c:
        async def one(t: str) -> tuple[int, str]:
            async with sem:
                try:
                    r = await c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": t, "temperature": 0,
                                                                   "max_tokens": max_tokens, "ignore_eos": True})
                except httpx.HTTPError as e:
                    return 0, f"{type(e).__name__}: {e}"
                if r.status_code != 200:
                    return r.status_code, r.text[:300]
                return 200, r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(t) for t in texts)))


def counter(url: str, name: str) -> float:
    """A kvpath connector counter from an engine's /metrics (summed over its labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^vllm:kvpath_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))


def count(path: Path, pattern: str) -> int:
    try:
        return len(re.findall(pattern, path.read_text(errors="replace")))
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--words", type=int, default=500, help="most words per prompt (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2, help="the tiny model's layers (default %(default)s)")
    ap.add_argument("--steps", type=int, default=TRAINED_STEPS,
                    help="its training steps on the text kvpath ships (readable output; default %(default)s)")
    ap.add_argument("--verify-every", type=int, default=4, help="kv_verify sample:N on both engines")
    ap.add_argument("--no-pin-all", dest="pin_all", action="store_false",
                    help="bind only vLLM's OpenMP threads, as vLLM does (not every process of an engine)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    model = str(build_tiny_model(None, TinyModelSpec(layers=args.layers, steps=args.steps)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pd-tp-load-"))
    work.mkdir(parents=True, exist_ok=True)
    verify = {"kv_verify": f"sample:{args.verify_every}"}
    rows, t0 = [], time.monotonic()
    with Stack(model, work, 4, p_knobs=verify, d_knobs=verify, p_tp=2, pin_all=args.pin_all) as st:
        for rnd in range(1, args.rounds + 1):
            t1 = time.monotonic()
            res = asyncio.run(one_round(st.proxy, prompts(args.prompts, args.words, rnd), args.concurrency,
                                        args.max_tokens))
            wall = time.monotonic() - t1
            deadline = time.monotonic() + 30
            while (kv_usage(st.p.url), kv_usage(st.d.url)) != (0.0, 0.0) and time.monotonic() < deadline:
                time.sleep(0.5)
            usage = (kv_usage(st.p.url), kv_usage(st.d.url))
            ok = sum(s == 200 and bool(t) for s, t in res)
            errors = [f"{s}: {t[:120]!r}" for s, t in res if s != 200 or not t]
            rows.append({"round": rnd, "ok": ok, "n": len(res), "wall_s": wall, "kv_usage_after": usage,
                         "errors": errors[:5]})
            console.print(f"round {rnd}: {ok}/{len(res)} complete with output in {wall:.1f} s; KV usage after: "
                          f"P {usage[0]:.3f}, D {usage[1]:.3f}" + (f"; errors: {errors[:3]}" if errors else ""))
        status = httpx.get(st.proxy + "/status", timeout=10).json()
        checked = {k: counter(st.d.url, f"kv_verify_{k}") for k in ("ok", "mismatch")}
    silent = count(work / "d.log", r"P silent")
    mismatched = int(checked["mismatch"])
    t = Table(title=f"P TP=2 / D TP=1, no tp= in the pool: {args.rounds} rounds of {args.prompts} prompts "
                    f"(<= {args.words} words) at concurrency {args.concurrency}")
    for c in ("round", "complete", "wall s", "KV usage after (P, D)"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["round"]), f"{r['ok']}/{r['n']}", f"{r['wall_s']:.1f}",
                  f"{r['kv_usage_after'][0]:.3f}, {r['kv_usage_after'][1]:.3f}")
    console.print(t)
    p_inst = status.get("prefill", [])
    console.print(f"pushes ended 'P silent' (D's log): {silent}; kv_verify: {checked['ok']:.0f} pushes checked "
                  f"equal, {mismatched} mismatched; "
                  f"P's TP size at the proxy: {[(i.get('tp_size'), i.get('tp_source')) for i in p_inst]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "p_silent": silent, "kv_verify": checked,
                                               "wall_s": time.monotonic() - t0}, indent=1))
    console.print(f"logs in {work}; {time.monotonic() - t0:.0f} s")
    good = (all(r["ok"] == r["n"] and r["kv_usage_after"] == (0.0, 0.0) for r in rows) and not silent
            and not mismatched and checked["ok"] > 0)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
