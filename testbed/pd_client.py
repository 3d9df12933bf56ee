"""A minimal P-then-D client for KVPathConnector, for the demo and the end-to-end tests
(the proxy, ``kvpath.proxy``, adds instance choice, path reservation and streaming).

``sequential``: P leg (max_tokens=1) first, then D with P's returned params.
``concurrent``: both legs at once, as the proxy does, so D can register first.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from kvpath.connector.params import decode_leg_params, new_transfer_key, prefill_leg_params


@dataclass
class PDResult:
    prompt: str
    text: str
    transfer_id: str
    ttft_s: float  # until D's completion came back (non-streaming: whole request)
    p_leg_s: float
    status: int = 200
    error: str = ""


def engine_client(timeout_s: float = 120.0) -> httpx.AsyncClient:
    """A client for requests to vLLM engines (or the proxy), without keep-alive: uvicorn closes
    an idle connection after 5 s, and a request that reuses one as it closes fails with
    a ReadError (seen in CI while a P/D request's other leg took longer than that)."""
    return httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))


D_HEAD_START_S = 1.5  # mode d_first: the D leg's lead over the P leg


async def pd_request(
    client: httpx.AsyncClient,
    p_url: str,
    d_url: str,
    p_peer: str,
    prompt: str,
    max_tokens: int = 16,
    mode: str = "sequential",
    lane: int | None = None,
    model: str = "tiny",
    p_tp_size: int = 0,
    granularity: str = "",
) -> PDResult:
    """One request through P then D. ``p_tp_size``: P's TP size, for the D leg of the
    concurrent mode (the sequential one passes on what P answered, which names it);
    ``granularity``: the request's push granularity ("": P's knob)."""
    tid = uuid.uuid4().hex
    body = {"model": model, "prompt": prompt, "temperature": 0}
    t0 = time.perf_counter()
    key = new_transfer_key()  # only a registration carrying it gets this transfer's KV
    p_body = {**body, "max_tokens": 1, "kv_transfer_params": prefill_leg_params(tid, lane, transfer_key=key,
                                                                                 push_granularity=granularity)}
    if mode == "sequential":
        rp = await client.post(f"{p_url}/v1/completions", json=p_body)
        p_leg = time.perf_counter() - t0
        if rp.status_code != 200:
            return PDResult(prompt, "", tid, 0.0, p_leg, rp.status_code, rp.text)
        d_params = rp.json()["kv_transfer_params"]
        rd = await client.post(f"{d_url}/v1/completions", json={**body, "max_tokens": max_tokens, "kv_transfer_params": d_params})
    elif mode in ("concurrent", "d_first"):
        d_body = {**body, "max_tokens": max_tokens, "kv_transfer_params": decode_leg_params(tid, p_peer, transfer_key=key,
                                                                                           tp_size=p_tp_size)}
        d_leg = asyncio.ensure_future(client.post(f"{d_url}/v1/completions", json=d_body))
        if mode == "d_first":  # D's registration waits at P before P's forward: a layer-wise push overlaps it
            await asyncio.sleep(D_HEAD_START_S)
        rd, rp = await asyncio.gather(d_leg, client.post(f"{p_url}/v1/completions", json=p_body),
                                      return_exceptions=True)
        p_leg = time.perf_counter() - t0
        if isinstance(rd, BaseException):
            return PDResult(prompt, "", tid, 0.0, p_leg, 0, repr(rd))
    else:
        raise ValueError(f"mode must be sequential, concurrent or d_first, got {mode!r}")
    elapsed = time.perf_counter() - t0
    if rd.status_code != 200:
        return PDResult(prompt, "", tid, elapsed, p_leg, rd.status_code, rd.text)
    data: dict[str, Any] = rd.json()
    choice = data["choices"][0]
    if choice.get("finish_reason") == "error":
        return PDResult(prompt, choice.get("text", ""), tid, elapsed, p_leg, 500, "finish_reason=error")
    return PDResult(prompt, choice["text"], tid, elapsed, p_leg)


async def direct_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = 16, model: str = "tiny") -> str:
    r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def pd_and_decode_only(
    client: httpx.AsyncClient,
    p_url: str,
    d_url: str,
    p_peer: str,
    prompts: list[str],
    max_tokens: int = 16,
    mode: str = "sequential",
    ref_url: str | None = None,
    model: str = "tiny",
    p_tp_size: int = 0,
    granularity: str = "",
) -> tuple[list[str], list[PDResult]]:
    """Each prompt's decode-only output (a plain greedy request, by default on P) and its
    P-then-D result, for checking that P/D changes nothing: the references all at once,
    then the P/D requests all at once. The references go first: D must not see the
    prompts before their pushes, or its prefix cache would serve them instead of the push."""
    ref_url = ref_url or p_url
    refs = await asyncio.gather(*(direct_request(client, ref_url, pr, max_tokens, model) for pr in prompts))
    got = await asyncio.gather(
        *(pd_request(client, p_url, d_url, p_peer, pr, max_tokens, mode=mode, model=model, p_tp_size=p_tp_size,
                     granularity=granularity)
          for pr in prompts)
    )
    return list(refs), list(got)


def make_prompts(n: int, seed: int = 0, min_words: int = 20, max_words: int = 120) -> list[str]:
    words = ("spine leaf lane path prefill decode block token layer head push pull proxy fabric link queue "
             "rate byte hash seed port route red green blue one two three").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]
