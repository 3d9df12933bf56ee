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

from kvpath.fabric import FabricSpec, FabricSpecError, pd_placement as placement
from kvpath.testbed import vllm_engines
from kvpath.testbed.counters import link_bytes, spine_flow_bytes
from kvpath.testbed.netns_fabric import LinkShaping, NetnsFabric
from kvpath.testbed.readiness import wait_http

logger = logging.getLogger(__name__)

ENGINE_PORT = vllm_engines.API_PORT  # every engine's HTTP port, on its management address
KV_PORT = vllm_engines.KV_PORT  # P's KV side channel, on its fabric address
PROXY_PORT = 18000
HEALTH_TIMEOUT_S = 30.0  # the proxy's /health probe timeout (see _proxy_argv)
MODES = ("ecmp", "cc", "dc")


class RunConfigError(ValueError):
    pass


@dataclass
class RunConfig:
    out: str
    fabric: str = "small"
    pools: str = "1P1D"
    engine: str = "emulated"  # emulated | vllm
    connector: str = "kvpath"  # vllm engines: kvpath (KVPathConnector, push) | nixl (vLLM's NixlConnector, pull)
    workload: str = "zipf"
    qps: float = 2.0
    requests: int = 40
    mode: str = "cc"
    seed: int = 0
    scale_b: float = 500.0
    scale_s: float | None = None  # default: 500 emulated; vllm engines move their real KV bytes (1)
    lanes: int = 4
    model: str = "llama-3-8b"
    accelerator: str = "h100"
    min_prompt: int | None = None  # default: 1024 emulated, 128 vllm (the tiny model's context is 2048)
    max_prompt: int | None = None  # default: 4096 emulated, 1024 vllm
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
        if self.engine not in ("emulated", "vllm"):
            raise RunConfigError(f"--engine must be emulated or vllm, got {self.engine!r}")
        if self.scale_s is None:
            self.scale_s = 500.0 if self.engine == "emulated" else 1.0
        if self.engine == "vllm" and self.scale_s != 1.0:
            raise RunConfigError("--scale-s: vLLM engines push their real KV bytes, so S is 1 with --engine vllm")
        if self.min_prompt is None:
            self.min_prompt = 1024 if self.engine == "emulated" else 128
        if self.max_prompt is None:
            self.max_prompt = 4096 if self.engine == "emulated" else 1024
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise RunConfigError(f"--min-prompt/--max-prompt: need 1 <= min <= max, got {self.min_prompt}, {self.max_prompt}")
        if self.engine == "vllm":
            if self.connector not in vllm_engines.CONNECTORS:
                raise RunConfigError(f"--connector must be one of {vllm_engines.CONNECTORS}, got {self.connector!r}")
            if self.connector == "nixl" and self.mode != "ecmp":
                raise RunConfigError("--connector nixl (vLLM's pull connector) cannot use a reserved path: "
                                     "its only mode is --mode ecmp")
            if self.max_prompt + self.max_output > vllm_engines.MAX_MODEL_LEN:
                raise RunConfigError(f"--max-prompt + --max-output must be <= {vllm_engines.MAX_MODEL_LEN} "
                                     "(the tiny model's context) with --engine vllm")
            try:
                vllm_engines.cpus_for(n_p + n_d)
            except ValueError as e:
                raise RunConfigError(f"--pools {self.pools}: {e}") from None
        elif self.connector != "kvpath":
            raise RunConfigError("--connector applies to --engine vllm only (emulated engines use kvpath's)")
        from kvpath.proxy.instances import POLICIES

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
    queue_bytes: int = 0  # tbf limit of the links: the buffer of each egress port
    decode_only: dict[str, Any] | None = None  # vllm engines: P/D output against P alone
    kv_loss: dict[str, int] | None = None  # vllm engines: vLLM's own count of lost KV transfers
    started: float = 0.0
    ended: float = 0.0


def _engine_argv(fabric: NetnsFabric, cfg: RunConfig, role: str, host: str, spec_arg: str, proxy_url: str,
                 out: Path) -> list[str]:
    ip = fabric.spec.host_ip(host)
    return fabric.exec_argv(host, [
        sys.executable, "-m", "kvpath.testbed.emulated_server", "--role", role, "--host", fabric.mgmt_ip(host),
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
    from kvpath.workloads import load_workload

    workload = load_workload(cfg.workload, n=cfg.requests, qps=cfg.qps, seed=cfg.seed, min_prompt=cfg.min_prompt,
                             max_prompt=cfg.max_prompt, pd_ratio=cfg.pd_ratio)
    procs: list[subprocess.Popen] = []
    servers: list[Any] = []
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    with NetnsFabric(spec, shaping, mgmt=True) as fabric:
        data = RunData(asdict(cfg), fabric.prefix, p_hosts, d_hosts, shaping.spine_mbit,
                       burst_bytes=shaping.burst_bytes, queue_bytes=shaping.queue_bytes)
        proxy_url = f"http://{fabric.MGMT_ROOT_IP}:{PROXY_PORT}"
        # pacing check: one flow alone, P's first host to D's first, about 0.3 s of bytes
        from kvpath.testbed.flowcheck import Flow, run_flows

        lone = run_flows(fabric, [Flow(p_hosts[0], d_hosts[0], 47000, 7000)],
                         int(shaping.spine_mbit * 1e6 / 8 * 0.3))[0]
        data.lone_flow_ratio = lone.mbit_s / min(shaping.host_mbit, shaping.spine_mbit)
        try:
            proxy = _spawn(_proxy_argv(fabric, cfg, spec_file, p_hosts, d_hosts), logs / "proxy.log")
            procs.append(proxy)
            if cfg.engine == "vllm":
                servers = _start_vllm(fabric, cfg, p_hosts, d_hosts, spec_file, proxy_url, out, logs)
            else:
                procs += _start_emulated(fabric, cfg, p_hosts, d_hosts, spec_file, proxy_url, out, logs)
            wait_http(f"{proxy_url}/health", proc=proxy, timeout_s=60, hint=f"see {logs / 'proxy.log'}")
            _wait_in_rotation(proxy_url)
            if cfg.engine == "vllm":
                _warm_up(proxy_url, cfg, n_p * n_d, console)
            else:
                _connect_all(fabric, p_hosts, d_hosts, proxy_url, n_p * n_d, console)
            # counters from here on: what the warm-up or the pre-connect moved is not the run's
            base_flows = spine_flow_bytes(fabric)
            base_links = link_bytes(fabric)
            data.started = time.time()
            data.client, data.cpu_idle = asyncio.run(_drive(proxy_url, workload, cfg, console))
            data.ended = time.time()
            if cfg.engine == "vllm":
                _settle_vllm(out, p_hosts, data.client, cfg)
                data.engine_records = vllm_engines.records(out, p_hosts, d_hosts, cfg.connector)
                prompts = {r.request_id: _prompt(i, r.prompt_tokens, cfg) for i, r in enumerate(workload.requests)}
                data.decode_only = vllm_engines.decode_only_check(
                    f"http://{fabric.mgmt_ip(p_hosts[0])}:{ENGINE_PORT}", data.client, prompts)
                data.kv_loss = vllm_engines.kv_loss_counts(
                    [f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}" for h in p_hosts + d_hosts])
            else:
                _settle(fabric, p_hosts + d_hosts)
                for h in p_hosts + d_hosts:
                    data.engine_records[h] = httpx.get(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/kvpath/records",
                                                       timeout=30).json()
            if cfg.connector == "kvpath":
                data.decisions = httpx.get(f"{proxy_url}/reservation/v1/decisions", timeout=30).json()["decisions"]
                data.lanes_known = httpx.get(f"{proxy_url}/reservation/v1/state", timeout=30).json()["lanes_known"]
            data.flow_bytes = {json.dumps(asdict(k)): v for k, v in _minus(spine_flow_bytes(fabric), base_flows).items()}
            data.link_bytes = {f"{n}:{i}": b - base_links.get((n, i), 0) for (n, i), b in link_bytes(fabric).items()}
        finally:
            for srv in servers:
                srv.kill()
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


def _minus(now: dict[Any, dict[str, int]], base: dict[Any, dict[str, int]]) -> dict[Any, dict[str, int]]:
    out = {}
    for k, per in now.items():
        was = base.get(k, {})
        diff = {spine: b - was.get(spine, 0) for spine, b in per.items() if b - was.get(spine, 0) > 0}
        if diff:
            out[k] = diff
    return out


def _proxy_argv(fabric: NetnsFabric, cfg: RunConfig, spec_file: Path, p_hosts: list[str],
                d_hosts: list[str]) -> list[str]:
    spec = fabric.spec
    # every engine shares this machine's cores (2 here): a /health answered late is a busy
    # engine, not a dead one, and with one instance per pool a probe timing out twice
    # would take the pool out of rotation and fail requests (a dead engine still leaves
    # rotation at once: its refused connections count as failed probes)
    argv = [sys.executable, "-m", "kvpath.cli", "proxy", "--host", fabric.MGMT_ROOT_IP, "--port", str(PROXY_PORT),
            "--first-byte-timeout-s", str(cfg.timeout_s), "--policy", cfg.policy,
            "--health-timeout-s", str(HEALTH_TIMEOUT_S)]
    if cfg.connector == "nixl":
        argv += ["--mode", "pull"]
    else:
        if cfg.engine == "vllm":
            from kvpath.tiny_model import TinyModelSpec

            t = TinyModelSpec()
            kvb = 2 * t.layers * t.kv_heads * t.head_dim * 4  # float32 K and V
        else:
            from kvpath.models import kv_bytes_per_token, model_preset

            kvb = max(1, round(kv_bytes_per_token(model_preset(cfg.model)) / cfg.scale_s))
        argv += ["--mode", "push", "--reservation", "inproc", "--reservation-mode", cfg.mode,
                 "--fabric", str(spec_file), "--kernel-oracle", fabric.prefix, "--dc-delay-s", str(cfg.dc_delay_s),
                 "--kv-bytes-per-token", str(kvb), "--lease-s", "60", "--reserve-at", cfg.reserve_at,
                 "--cc-metric", cfg.cc_metric]
    if cfg.engine == "vllm":
        for pl in _vllm_placements(fabric, p_hosts, d_hosts):
            argv += vllm_engines.proxy_instance_args(pl, cfg.connector)
        return argv
    for h in p_hosts:
        argv += ["--prefill", f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT},kv_addr={spec.host_ip(h)}:{KV_PORT},"
                              f"fabric_host={h},engine_id=p-{h}"]
    for h in d_hosts:
        argv += ["--decode", f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT},fabric_host={h}"]
    return argv


def _start_emulated(fabric: NetnsFabric, cfg: RunConfig, p_hosts: list[str], d_hosts: list[str], spec_file: Path,
                    proxy_url: str, out: Path, logs: Path) -> list[subprocess.Popen]:
    engines = {}
    for role, hosts in (("prefill", p_hosts), ("decode", d_hosts)):
        for h in hosts:
            engines[h] = _spawn(_engine_argv(fabric, cfg, role, h, str(spec_file), proxy_url, out),
                                logs / f"{role}-{h}.log")
    for h, proc in engines.items():
        wait_http(f"http://{fabric.mgmt_ip(h)}:{ENGINE_PORT}/health", proc=proc, timeout_s=120,
                  require_200=True, hint=f"see {logs}")
    return list(engines.values())


def _vllm_placements(fabric: NetnsFabric, p_hosts: list[str], d_hosts: list[str]) -> list[vllm_engines.Placement]:
    cpus = vllm_engines.cpus_for(len(p_hosts) + len(d_hosts))
    hosts = [("prefill", h) for h in p_hosts] + [("decode", h) for h in d_hosts]
    return [vllm_engines.Placement(h, role, fabric.spec.host_ip(h), fabric.mgmt_ip(h), cpu)
            for (role, h), cpu in zip(hosts, cpus)]


def _start_vllm(fabric: NetnsFabric, cfg: RunConfig, p_hosts: list[str], d_hosts: list[str], spec_file: Path,
                proxy_url: str, out: Path, logs: Path) -> list[Any]:
    from kvpath.tiny_model import build_tiny_model

    model = str(build_tiny_model(out / "tiny-model"))
    knobs = {"lanes": cfg.lanes, "reservation_url": f"{proxy_url}/reservation", "fabric_spec": str(spec_file),
             "kernel_oracle": fabric.prefix, "reserve_at": cfg.reserve_at}
    servers = [vllm_engines.server(pl, cfg.connector, model, fabric.exec_argv(pl.host, []), out, logs, knobs)
               for pl in _vllm_placements(fabric, p_hosts, d_hosts)]
    for srv in servers:
        srv.start()
    for srv in servers:
        srv.wait_ready(timeout_s=600)
    return servers


def _wait_in_rotation(proxy_url: str, timeout_s: float = 60.0) -> None:
    """The proxy took an engine that was still starting out of rotation: wait until its
    health probes put every instance back."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = httpx.get(f"{proxy_url}/status", timeout=10).json()
        down = [i["url"] for role in ("prefill", "decode") for i in st[role] if not i["healthy"]]
        if not down:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy still has {down} out of rotation after {timeout_s:.0f} s")
        time.sleep(0.5)


def _prompt(index: int, n: int, cfg: RunConfig) -> list[int]:
    return vllm_engines.prompt_ids(index, n, cfg.seed)


def _warm_up(proxy_url: str, cfg: RunConfig, pairs: int, console: Console) -> None:
    """vLLM has no pre-connect: one request per P-D pair (the proxy's policy spreads them)
    opens every pair's connections before the measured run, and with KVPathConnector
    registers the lanes (the first push of a pair has none to choose from otherwise)."""
    for i in range(2 * pairs):
        body = {"model": vllm_engines.MODEL_NAME, "prompt": _prompt(10**6 + i, 64, cfg), "max_tokens": 2,
                "temperature": 0}
        r = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"warm-up request through the proxy failed: {r.status_code} {r.text[:300]}")
        if cfg.connector != "kvpath":
            if i + 1 >= pairs:
                break
            continue
        known = httpx.get(f"{proxy_url}/reservation/v1/state", timeout=10).json()["lanes_known"]
        if sum(len(ws) for ws in known.values()) >= pairs:
            break
    console.log(f"warm-up done: connections open for {pairs} P-D pair(s)")


def _settle_vllm(out: Path, p_hosts: list[str], client: list[dict[str, Any]], cfg: RunConfig,
                 timeout_s: float = 30.0) -> None:
    """Wait until P's connector has written the end of every completed request's push."""
    if cfg.connector != "kvpath":
        return
    want = {c["transfer_id"] for c in client if c["status"] == "ok" and c.get("transfer_id")}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = set()
        for h in p_hosts:
            f = vllm_engines.transfer_trace(out, h)
            if f.exists():
                seen |= {json.loads(line)["transfer_id"] for line in f.read_text().splitlines()
                         if '"kv_transfer"' in line}
        if want <= seen:
            return
        time.sleep(0.5)
    logger.warning("%d pushes have no record in P's transfer trace after %.0f s", len(want - seen), timeout_s)


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

        async def one(i: int, r: Any) -> None:
            out = min(r.output_tokens, cfg.max_output)
            model = vllm_engines.MODEL_NAME if cfg.engine == "vllm" else cfg.model
            body = {"model": model, "prompt": _prompt(i, r.prompt_tokens, cfg), "max_tokens": out, "stream": True,
                    "temperature": 0}
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.time()))
            row: dict[str, Any] = {"request_id": r.request_id, "arrival": time.time(), "prompt_tokens": r.prompt_tokens,
                                   "output_tokens": out, "max_tokens": out, "status": "ok", "tokens": 0, "text": ""}
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
                        row["text"] += ev["choices"][0].get("text", "") if ev.get("choices") else ""
                        row["completion"] = now
            except httpx.HTTPError as e:
                row["status"] = f"client error: {e}"
            # the proxy's transfer id: vLLM names the completion cmpl-<X-Request-Id>
            m = re.match(r"cmpl-([0-9a-f]{32})", row.get("id", ""))
            row["transfer_id"] = m.group(1) if m else ""
            rows.append(row)
            progress.advance(task)

        sampler = asyncio.create_task(sample_cpu())
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{cfg.mode}: {len(reqs)} requests at {cfg.qps} QPS", total=len(reqs))
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        sampler.cancel()
    return rows, idle
