"""``kvpath testbed run``: a whole P/D serving run on an emulated fabric.

It builds the fabric (with a management network for HTTP), starts the engines in their
host namespaces (P on the first half of the leaves, D on the second half, so every
push crosses the spines), starts the proxy with its in-process reservation service
(the kernel path oracle, the given mode), pre-connects every D to every P so all lanes
are open and registered, drives the workload through the proxy, collects what every
part recorded, and tears everything down. The joined rows are written by
``testbed/run_report.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.progress import Progress

from kvpath.fabric import FabricSpec, FabricSpecError
from testbed.counters import link_bytes, spine_flow_bytes
from testbed.netns_fabric import LinkShaping, NetnsFabric
from testbed.readiness import wait_http

logger = logging.getLogger(__name__)

ENGINE_PORT = 8000
KV_PORT = 5600
PROXY_PORT = 18000
MODES = ("ecmp", "cc", "dc")


class RunConfigError(ValueError):
    pass


@dataclass
class RunConfig:
    out: str
    fabric: str = "small"
    pools: str = "1P1D"
    engine: str = "emulated"
    workload: str = "zipf"
    qps: float = 2.0
    requests: int = 40
    mode: str = "cc"
    seed: int = 0
    scale_b: float = 500.0
    scale_s: float = 500.0
    lanes: int = 4
    model: str = "llama-3-8b"
    accelerator: str = "h100"
    min_prompt: int = 1024
    max_prompt: int = 4096
    pd_ratio: float = 20.0
    max_output: int = 64
    dc_delay_s: float = 0.0
    policy: str = "round_robin"  # the proxy's choice of P and D instances
    reserve_at: str = "admission"  # when a push's lane is reserved: proxy admission or push start
    cc_metric: str = "flows"  # cc/dc's load measure: reserved flows or bytes on a path's busiest link
    timeout_s: float = 600.0

    def validate(self) -> tuple[FabricSpec, int, int]:
        try:
            spec = FabricSpec.resolve(self.fabric)
        except FabricSpecError as e:
            raise RunConfigError(f"--fabric: {e}") from None
        m = re.fullmatch(r"(\d+)P(\d+)D", self.pools)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise RunConfigError(f"--pools must look like 8P8D, got {self.pools!r}")
        n_p, n_d = int(m.group(1)), int(m.group(2))
        if spec.leaves < 2:
            raise RunConfigError("--fabric needs at least 2 leaves (P and D on different leaves)")
        half = spec.leaves // 2
        if n_p > half * spec.hosts_per_leaf or n_d > (spec.leaves - half) * spec.hosts_per_leaf:
            raise RunConfigError(f"--pools {self.pools} does not fit: {half * spec.hosts_per_leaf} hosts for P "
                                 f"and {(spec.leaves - half) * spec.hosts_per_leaf} for D on this fabric")
        if self.engine not in ("emulated",):
            raise RunConfigError(f"--engine {self.engine!r}: only 'emulated' is implemented so far")
        from proxy.instances import POLICIES

        if self.policy not in POLICIES:
            raise RunConfigError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cc_metric not in ("flows", "bytes"):
            raise RunConfigError(f"--cc-metric must be flows or bytes, got {self.cc_metric!r}")
        if self.reserve_at not in ("admission", "push"):
            raise RunConfigError(f"--reserve-at must be admission or push, got {self.reserve_at!r}")
        if self.mode not in MODES:
            raise RunConfigError(f"--mode must be one of {MODES}, got {self.mode!r}")
        for name in ("qps", "scale_b", "scale_s", "pd_ratio"):
            if getattr(self, name) <= 0:
                raise RunConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.requests < 1:
            raise RunConfigError("--requests must be >= 1")
        return spec, n_p, n_d


def placement(spec: FabricSpec, n_p: int, n_d: int) -> tuple[list[str], list[str]]:
    """P hosts on leaves [0, L/2), D hosts on [L/2, L), spread across leaves first."""
    half = spec.leaves // 2

    def spread(leaves: range, n: int) -> list[str]:
        order = [spec.host_name(l, h) for h in range(spec.hosts_per_leaf) for l in leaves]
        return order[:n]

    return spread(range(half), n_p), spread(range(half, spec.leaves), n_d)


@dataclass
class RunData:
    """Everything a run collected, before it is joined into the trace."""

    config: dict[str, Any]
    prefix: str
    p_hosts: list[str]
    d_hosts: list[str]
    link_mbit: float
    client: list[dict[str, Any]] = field(default_factory=list)
    engine_records: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfers: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    lanes_known: dict[str, Any] = field(default_factory=dict)
    flow_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)
    cpu_idle: list[float] = field(default_factory=list)
    lone_flow_ratio: float | None = None  # a lone flow's rate / the link rate, before the run
    burst_bytes: int = 0  # tbf burst of the links
    started: float = 0.0
    ended: float = 0.0


def _engine_argv(fabric: NetnsFabric, cfg: RunConfig, role: str, host: str, spec_arg: str, proxy_url: str,
                 out: Path) -> list[str]:
    ip = fabric.spec.host_ip(host)
    return fabric.exec_argv(host, [
        sys.executable, "-m", "testbed.emulated_server", "--role", role, "--host", fabric.mgmt_ip(host),
        "--port", str(ENGINE_PORT), "--kv-host", ip, "--kv-port", str(KV_PORT), "--ucx-dev", "eth0",
        "--model", cfg.model, "--accelerator", cfg.accelerator, "--scale-b", str(cfg.scale_b),
        "--scale-s", str(cfg.scale_s), "--lanes", str(cfg.lanes), "--fabric", spec_arg, "--fabric-host", host,
        "--kernel-oracle", fabric.prefix, "--reservation-url", f"{proxy_url}/reservation",
        "--trace", str(out / f"transfers-{host}.jsonl"), "--engine-id", f"{role[0]}-{host}",
        "--reserve-at", cfg.reserve_at,
    ])


def run(cfg: RunConfig, console: Console | None = None) -> RunData:
    spec, n_p, n_d = cfg.validate()
    console = console or Console(stderr=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "fabric.json"
    spec_file.write_text(json.dumps(spec.to_dict(), indent=1))
    p_hosts, d_hosts = placement(spec, n_p, n_d)
    shaping = LinkShaping.scaled(spec, cfg.scale_b)
    from kvpath.models import kv_bytes_per_token, model_preset
    from kvpath.workloads import load_workload

    workload = load_workload(cfg.workload, n=cfg.requests, qps=cfg.qps, seed=cfg.seed, min_prompt=cfg.min_prompt,
                             max_prompt=cfg.max_prompt, pd_ratio=cfg.pd_ratio)
    kvb = kv_bytes_per_token(model_preset(cfg.model))
    procs: list[subprocess.Popen] = []
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    with NetnsFabric(spec, shaping, mgmt=True) as fabric:
        data = RunData(asdict(cfg), fabric.prefix, p_hosts, d_hosts, shaping.spine_mbit,
                       burst_bytes=shaping.burst_bytes)
        proxy_url = f"http://{fabric.MGMT_ROOT_IP}:{PROXY_PORT}"
        # pacing check: one flow alone, P's first host to D's first, about 0.3 s of bytes
        from testbed.flowcheck import Flow, run_flows

        lone = run_flows(fabric, [Flow(p_hosts[0], d_hosts[0], 47000, 7000)],
                         int(shaping.spine_mbit * 1e6 / 8 * 0.3))[0]
        data.lone_flow_ratio = lone.mbit_s / min(shaping.host_mbit, shaping.spine_mbit)
        try:
            argv = [sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--host", fabric.MGMT_ROOT_IP,
                    "--port", str(PROXY_PORT), "--reservation", "inproc", "--reservation-mode", cfg.mode,
                    "--fabric", str(spec_file), "--kernel-oracle", fabric.prefix, "--dc-delay-s", str(cfg.dc_delay_s),
                    "--kv-bytes-per-token", str(max(1, round(kvb / cfg.scale_s))), "--lease-s", "60",
                    "--first-byte-timeout-s", str(cfg.timeout_s), "--policy", cfg.policy,
                    "--reserve-at", cfg.reserve_at, "--cc-metric", cfg.cc_metric]
            for h in p_hosts:
                argv += ["--prefill", f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT},kv_addr={spec.host_ip(h)}:{KV_PORT},"
                                      f"fabric_host={h},engine_id=p-{h}"]
            for h in d_hosts:
                argv += ["--decode", f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT},fabric_host={h}"]
            proxy = _spawn(argv, logs / "proxy.log")
            procs.append(proxy)
            engines = {}
            for role, hosts in (("prefill", p_hosts), ("decode", d_hosts)):
                for h in hosts:
                    engines[h] = _spawn(_engine_argv(fabric, cfg, role, h, str(spec_file), proxy_url, out),
                                        logs / f"{role}-{h}.log")
            procs += list(engines.values())
            for h, proc in engines.items():
                wait_http(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/health", proc=proc, timeout_s=120,
                          require_200=True, hint=f"see {logs}")
            wait_http(f"{proxy_url}/health", proc=proxy, timeout_s=60, hint=f"see {logs / 'proxy.log'}")
            _connect_all(fabric, p_hosts, d_hosts, proxy_url, n_p * n_d, console)
            data.started = time.time()
            data.client, data.cpu_idle = asyncio.run(_drive(proxy_url, workload, cfg, console))
            data.ended = time.time()
            _settle(fabric, p_hosts + d_hosts)
            for h in p_hosts + d_hosts:
                data.engine_records[h] = httpx.get(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/kvpath/records",
                                                   timeout=30).json()
            data.decisions = httpx.get(f"{proxy_url}/reservation/v1/decisions", timeout=30).json()["decisions"]
            data.lanes_known = httpx.get(f"{proxy_url}/reservation/v1/state", timeout=30).json()["lanes_known"]
            data.flow_bytes = {json.dumps(asdict(k)): v for k, v in spine_flow_bytes(fabric).items()}
            data.link_bytes = {f"{n}:{i}": b for (n, i), b in link_bytes(fabric).items()}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    received: dict[str, float] = {}
    for h in p_hosts + d_hosts:
        f = out / f"transfers-{h}.jsonl"
        if f.exists():
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            data.transfers += [dict(r, p_host=h) for r in rows if r.get("kind") == "kv_transfer"]
            received.update({r["transfer_id"]: r["at"] for r in rows if r.get("kind") == "kv_received"})
    for t in data.transfers:
        t["received_at"] = received.get(t["transfer_id"])
    return data


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, UCX_TLS="tcp", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _connect_all(fabric: NetnsFabric, p_hosts: list[str], d_hosts: list[str], proxy_url: str, pairs: int,
                 console: Console) -> None:
    """Every D says Hello to every P now: P opens and registers its lanes, so every push
    of the run has lanes to choose from (the first request of a pair would not)."""
    peers = [f"{fabric.spec.host_ip(h)}:{KV_PORT}" for h in p_hosts]
    for h in d_hosts:
        r = httpx.post(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/kvpath/connect", json={"peers": peers}, timeout=30)
        r.raise_for_status()
    deadline = time.monotonic() + 120
    while True:
        known = httpx.get(f"{proxy_url}/reservation/v1/state", timeout=10).json()["lanes_known"]
        n = sum(len(ws) for ws in known.values())
        if n >= pairs:
            console.log(f"lanes open and registered for all {pairs} P-D pairs")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {n} of {pairs} P-D pairs registered lanes in 120 s")
        time.sleep(0.5)


def _settle(fabric: NetnsFabric, hosts: list[str], timeout_s: float = 30.0) -> None:
    """Wait until every engine's KV blocks are free again (pushes released)."""
    deadline = time.monotonic() + timeout_s
    for h in hosts:
        while time.monotonic() < deadline:
            if httpx.get(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/kvpath/records", timeout=10).json()["kv_usage"] == 0:
                break
            time.sleep(0.2)


async def _drive(proxy_url: str, workload: Any, cfg: RunConfig, console: Console) -> tuple[list[dict], list[float]]:
    rows: list[dict[str, Any]] = []
    idle: list[float] = []
    reqs = list(workload.requests)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        t0 = time.time() + 0.2
        psutil.cpu_times_percent(None)

        async def sample_cpu() -> None:
            while True:
                await asyncio.sleep(1.0)
                idle.append(psutil.cpu_times_percent(None).idle)

        async def one(r: Any) -> None:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.time()))
            out = min(r.output_tokens, cfg.max_output)
            body = {"model": cfg.model, "prompt": [7] * r.prompt_tokens, "max_tokens": out, "stream": True}
            row: dict[str, Any] = {"request_id": r.request_id, "arrival": time.time(), "prompt_tokens": r.prompt_tokens,
                                   "output_tokens": out, "status": "ok", "tokens": 0}
            try:
                async with client.stream("POST", f"{proxy_url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        row["status"] = f"http {resp.status_code}"
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            row["status"] = f"error: {ev['error'].get('message', '')[:200]}"
                            continue
                        now = time.time()
                        row.setdefault("first_token", now)
                        row.setdefault("id", ev.get("id", ""))
                        row["tokens"] += 1
                        row["completion"] = now
            except httpx.HTTPError as e:
                row["status"] = f"client error: {e}"
            m = re.fullmatch(r"cmpl-(.+)-0", row.get("id", ""))
            row["transfer_id"] = m.group(1) if m else ""
            rows.append(row)
            progress.advance(task)

        sampler = asyncio.create_task(sample_cpu())
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{cfg.mode}: {len(reqs)} requests at {cfg.qps} QPS", total=len(reqs))
            await asyncio.gather(*(one(r) for r in reqs))
        sampler.cancel()
    return rows, idle
