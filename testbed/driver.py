"""The testbed run's client: it sends the workload's requests through the proxy at their
arrival times, streams each answer, and records per request when it arrived, its first
token and its end, the text, and the transfer id the proxy gave its KV push.

It runs on aiohttp (as ``vllm bench serve`` does), not httpx: on this 2-core machine the
client shares the cores with the engines, and at 60 QPS httpx's per-line streaming kept
the client's loop about 90% busy (py-spy): requests reached P 67 ms after the client
sent them on average, 39 ms with aiohttp on the same load. That is a cost of the load
generator, not of the system it measures."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import Progress

from kvpath.proxy.config import TRANSFER_ID_HEADER  # the proxy names each request's transfer id there
from kvpath.testbed.cpu_sampler import CpuSampler
from kvpath.testbed.run_config import RunConfig

# ids every tiny tokenizer has: 4 special tokens, then the 256-symbol byte alphabet
# (its BPE merges depend on the corpus, so the vocabulary's size is not fixed)
PROMPT_IDS = (4, 260)
EXTRA_EVENTS = 8  # events past max_tokens a stream may carry before the client gives up on it


def prompt_ids(request_index: int, n: int, seed: int) -> list[int]:
    """A request's prompt as token ids: distinct per request (no shared prefix to cache),
    the same for the same seed."""
    import numpy as np

    rng = np.random.default_rng([seed, request_index])
    return rng.integers(*PROMPT_IDS, size=n).tolist()


async def drive(proxy_url: str, workload: Any, cfg: RunConfig, model_name: str,
                console: Console) -> tuple[list[dict[str, Any]], list[float]]:
    """Every request of ``workload`` through the proxy; returns one row per request and the
    machine's CPU idle percentage, sampled once a second while they ran."""
    rows: list[dict[str, Any]] = []
    reqs = list(workload.requests)
    connector = aiohttp.TCPConnector(limit=1024, ttl_dns_cache=None)
    # per wait, as httpx's was: a long streamed answer is not cut off, a silent proxy is
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout_s, sock_read=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        t0 = time.time() + 0.2
        cpu = CpuSampler().start()

        async def one(i: int, r: Any) -> None:
            out = min(r.output_tokens, cfg.max_output)
            body = {"model": model_name, "prompt": prompt_ids(i, r.prompt_tokens, cfg.seed), "max_tokens": out,
                    "stream": True, "temperature": 0}
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.time()))
            row: dict[str, Any] = {"request_id": r.request_id, "arrival": time.time(), "prompt_tokens": r.prompt_tokens,
                                   "output_tokens": out, "max_tokens": out, "status": "ok", "tokens": 0, "text": "",
                                   "transfer_id": ""}
            tid = ""
            try:
                async with client.post(f"{proxy_url}/v1/completions", json=body) as resp:
                    tid = resp.headers.get(TRANSFER_ID_HEADER, "")
                    if resp.status != 200:
                        row["status"] = f"http {resp.status}"
                    lines = 0
                    async for line in resp.content:  # a line over 512 KiB raises: bounded
                        text = line.decode("utf-8", "replace").rstrip("\r\n")
                        _event(row, text)
                        if row["tokens"] > out + EXTRA_EVENTS:
                            raise ValueError(f"more than {out} tokens streamed")
                        lines += bool(text)  # events that are no token (usage, comments) count too
                        if lines > out + EXTRA_EVENTS:
                            raise ValueError(f"more than {out + EXTRA_EVENTS} events streamed for {out} tokens")
            except Exception as e:  # anything the proxy sends ends this request, never the run
                row["status"] = f"client error: {e!r}"[:300]
            # a push happened only if tokens came back (the answer may still end in an
            # error, or the stream break after them): one that failed before its first
            # token has no push record to wait for
            if row["tokens"]:
                row["transfer_id"] = tid
            rows.append(row)
            progress.advance(task)

        try:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task(f"{cfg.mode}: {len(reqs)} requests at {cfg.qps} QPS", total=len(reqs))
                await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        finally:
            idle = [c.idle for c in cpu.stop(wait=False)]  # the seconds that ended while the requests ran
    return rows, idle


def _event(row: dict[str, Any], line: str) -> None:
    """One server-sent event of a streamed completion into the request's row."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    ev = json.loads(line[6:])
    if "error" in ev:
        row["status"] = f"error: {ev['error'].get('message', '')[:200]}"
        return
    choices = ev.get("choices")
    if choices == []:  # a usage-only chunk (stream_options.include_usage) carries no token
        return
    if not isinstance(choices, list):
        raise ValueError(f"an event's choices is not a list: {str(choices)[:80]}")
    text = choices[0].get("text", "")
    if not isinstance(text, str):
        raise ValueError(f"an event's text is not a string: {str(text)[:80]}")
    now = time.time()
    row.setdefault("first_token", now)
    row["tokens"] += 1
    row["text"] += text
    row["completion"] = now
