"""``kvpath testbed run``: a whole P/D serving run on an emulated fabric.

It builds the fabric (with a management network for HTTP), starts the proxy with its
in-process reservation service (the kernel path oracle, the given mode) and the engines
in their host namespaces (P on the first half of the leaves, D on the second half, so
every push crosses the spines), warms every P-D pair up so all lanes are open and
registered, drives the workload through the proxy (:mod:`kvpath.testbed.driver`),
collects what every part recorded, and tears everything down. The engines' kind is
chosen once (:func:`kvpath.testbed.engine_kinds.engines_for`); ``testbed/run_report.py``
joins what was collected. :func:`serving` is the part before the workload (fabric,
proxy, engines, warm-up), for a client of one's own (``benchmarks/serve_compare.py``
runs ``vllm bench serve`` in it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from kvpath.fabric import pd_placement as placement
from kvpath.testbed.counters import link_bytes, port_drops, spine_flow_bytes, tcp_retransmits
from kvpath.testbed.driver import drive
from kvpath.testbed.engine_kinds import engines_for
from kvpath.testbed.engines import Engines, RunSite
from kvpath.testbed.netns_fabric import LinkShaping, NetnsFabric
from kvpath.testbed.readiness import spawn, terminate, wait_http
from kvpath.testbed.run_config import RunConfig
from kvpath.trace import ReceivedRecord, TransferRecord, read_connector_log, received_by_flow

logger = logging.getLogger(__name__)
PROXY_PORT = 18000
PACING_TRIES = 4  # connections the pacing check may try (below)
HEALTH_TIMEOUT_S = 30.0  # the proxy's /health probe timeout (see proxy_argv)


@dataclass(frozen=True)
class Push:
    """One push of the run: P's connector's record of it, P's host, and when D had its
    last byte (D's connector's record; None if it has none)."""

    record: TransferRecord
    p_host: str
    received_at: float | None = None

    @property
    def end(self) -> float | None:
        """The push ends when D has the last byte (its notification), not when UCX on P says DONE."""
        return self.received_at or self.record.completed_at


@dataclass
class RunData:
    """Everything a run collected, before it is joined into the trace."""

    config: dict[str, Any]
    prefix: str
    p_hosts: list[str]
    d_hosts: list[str]
    link_mbit: float  # the spine links'
    client: list[dict[str, Any]] = field(default_factory=list)
    engine_records: dict[str, dict[str, Any]] = field(default_factory=dict)
    transfers: list[Push] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    lanes_known: dict[str, Any] = field(default_factory=dict)
    lane_log: list[dict[str, Any]] = field(default_factory=list)  # the lane registry's changes (replay)
    cost_model: dict[str, Any] | None = None  # the reservation service's placement cost model
    lanes_complete_from_seq: int = 0  # the lane log rebuilds the registry from this decision on
    flow_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)
    port_drops: dict[str, int] = field(default_factory=dict)  # "node:ifname" -> packets its qdisc dropped
    tcp_retrans: dict[str, int] = field(default_factory=dict)  # P/D host -> TCP segments it retransmitted
    cpu_idle: list[float] = field(default_factory=list)
    lone_flow_ratio: float | None = None  # a lone flow's rate / the link rate, before the run
    lone_flow_tries: list[float] = field(default_factory=list)  # every try's ratio (the pacing check)
    burst_bytes: int = 0  # tbf burst of the links
    queue_bytes: int = 0  # tbf limit of the links: the buffer of each egress port
    host_link_mbit: float | None = None  # the host links' rate (link_mbit: the spine links')
    decode_only: dict[str, Any] | None = None  # vllm engines: P/D output against P alone
    kv_loss: dict[str, int] | None = None  # vllm engines: vLLM's own count of lost KV transfers
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Serving:
    """A fabric with the proxy and the engines up, every P-D pair warmed up: what
    :func:`serving` hands to a client (the workload driver of :func:`run`, or another
    client such as ``vllm bench serve`` pointed at ``proxy_url``)."""

    site: RunSite
    engines: Engines
    proxy_url: str  # on the management network, reachable from the root namespace
    shaping: LinkShaping
    lone_flow_ratio: float  # a lone flow's rate / the link rate, measured before the proxy and engines started
    lone_flow_tries: list[float] = field(default_factory=list)  # every connection the pacing check tried

    @property
    def fabric(self) -> NetnsFabric:
        return self.site.fabric

    def run_data(self) -> RunData:
        """An empty :class:`RunData` of this run (configuration, hosts, link rate, the lone flow)."""
        site, sh = self.site, self.shaping
        return RunData(asdict(site.cfg), site.fabric.prefix, site.p_hosts, site.d_hosts, sh.spine_mbit,
                       lone_flow_ratio=self.lone_flow_ratio, lone_flow_tries=list(self.lone_flow_tries),
                       burst_bytes=sh.burst_bytes, queue_bytes=sh.queue_bytes,
                       host_link_mbit=sh.host_mbit)

    def counters(self) -> Counters:
        """The spines' per-5-tuple counters, the links' byte and drop counters and the
        engine hosts' TCP retransmissions now."""
        return Counters(spine_flow_bytes(self.fabric), link_bytes(self.fabric), port_drops(self.fabric),
                        tcp_retransmits(self.fabric, self.site.p_hosts + self.site.d_hosts))

    def count_since(self, data: RunData, base: Counters) -> None:
        """Fill ``data.flow_bytes``, ``data.link_bytes``, ``data.port_drops`` and
        ``data.tcp_retrans`` with what moved since ``base``."""
        now = self.counters()
        data.flow_bytes = {json.dumps(k.to_dict()): v for k, v in _minus(now.flows, base.flows).items()}
        data.link_bytes = {f"{n}:{i}": b - base.links.get((n, i), 0) for (n, i), b in now.links.items()}
        data.port_drops = {f"{n}:{i}": d - base.drops.get((n, i), 0) for (n, i), d in now.drops.items()}
        data.tcp_retrans = {h: r - base.retrans.get(h, 0) for h, r in now.retrans.items()}


@dataclass(frozen=True)
class Counters:
    """A snapshot of the fabric's counters (:meth:`Serving.counters`)."""

    flows: dict[Any, dict[str, int]]
    links: dict[tuple[str, str], int]
    drops: dict[tuple[str, str], int]
    retrans: dict[str, int]


@contextmanager
def serving(cfg: RunConfig, console: Console | None = None) -> Iterator[Serving]:
    """Steps 1-4 of a run: build the fabric with its management network, check a lone
    flow's pacing, start the proxy and the engines, wait until the proxy has every engine
    in rotation, warm every P-D pair up; then hand over. Leaving stops the engines and
    the proxy and tears the fabric down."""
    spec, n_p, n_d = cfg.validate()
    console = console or Console(stderr=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "fabric.json"
    spec_file.write_text(json.dumps(spec.to_dict(), indent=1))
    p_hosts, d_hosts = placement(spec, n_p, n_d)
    shaping = LinkShaping.scaled(spec, cfg.scale_b)
    (out / "logs").mkdir(exist_ok=True)
    with NetnsFabric(spec, shaping, mgmt=True) as fabric:
        site = RunSite(fabric, cfg, p_hosts, d_hosts, spec_file, out)
        engines = engines_for(site)
        proxy_url = f"http://{fabric.MGMT_ROOT_IP}:{PROXY_PORT}"
        # pacing check: one flow alone, P's first host to D's first, about 0.3 s of bytes.
        # Where the spine links are slower than the hosts' (rack4-os2), a connection's slow
        # start can overshoot the leaf's uplink queue and wait out a retransmission timeout
        # (measured: 0.65 of the rate in 5 of 8 connections, 1.03 in the others): that is
        # TCP, not the machine, so up to PACING_TRIES connections are tried and the best kept
        from kvpath.testbed.flowcheck import Flow, run_flows

        bottleneck = min(shaping.host_mbit, shaping.spine_mbit)
        ratios: list[float] = []
        while len(ratios) < PACING_TRIES and not any(0.9 <= r <= 1.1 for r in ratios):
            flow = Flow(p_hosts[0], d_hosts[0], 47000 + len(ratios), 7000)
            ratios.append(run_flows(fabric, [flow], int(bottleneck * 1e6 / 8 * 0.3))[0].mbit_s / bottleneck)
        if len(ratios) > 1:
            logger.info("pacing check: lone flows at %s of the link rate", ", ".join(f"{r:.2f}" for r in ratios))
        s = Serving(site, engines, proxy_url, shaping, next((r for r in ratios if 0.9 <= r <= 1.1), max(ratios)),
                    ratios)
        proxy = spawn(proxy_argv(site, engines), site.logs / "proxy.log")
        try:
            engines.start(proxy_url)
            wait_http(f"{proxy_url}/health", proc=proxy, timeout_s=60, hint=f"see {site.logs / 'proxy.log'}")
            wait_in_rotation(proxy_url)
            engines.warm_up(proxy_url, console)
            yield s
        finally:
            engines.stop()
            terminate([proxy])


def run(cfg: RunConfig, console: Console | None = None) -> RunData:
    cfg.validate()
    console = console or Console(stderr=True)
    from kvpath.workloads import load_workload

    workload = load_workload(cfg.workload, n=cfg.requests, qps=cfg.qps, seed=cfg.seed, min_prompt=cfg.min_prompt,
                             max_prompt=cfg.max_prompt, pd_ratio=cfg.pd_ratio)
    with serving(cfg, console) as s:
        engines, proxy_url = s.engines, s.proxy_url
        data = s.run_data()
        # counters from here on: what the warm-up moved is not the run's
        base = s.counters()
        data.started = time.time()
        data.client, data.cpu_idle = asyncio.run(drive(proxy_url, workload, cfg, engines.model_name, console))
        data.ended = time.time()
        engines.settle(data.client)
        data.engine_records = engines.records()
        data.decode_only = engines.decode_only(data.client, workload)
        data.kv_loss = engines.kv_loss()
        if cfg.pushes:
            hdr = s.site.admin_headers()
            log = httpx.get(f"{proxy_url}/reservation/v1/decisions", headers=hdr, timeout=30).json()
            data.decisions, data.lane_log, data.cost_model = log["decisions"], log["lanes"], log["cost_model"]
            data.lanes_complete_from_seq = log["lanes_complete_from_seq"]
            data.lanes_known = httpx.get(f"{proxy_url}/reservation/v1/state", headers=hdr,
                                         timeout=30).json()["lanes_known"]
        s.count_since(data, base)
    data.transfers = pushes(s.site)
    return data


def pushes(site: RunSite) -> list[Push]:
    """Every push the connectors recorded: P's records, each with when D received it."""
    p_recs: list[tuple[TransferRecord, str]] = []
    received: list[ReceivedRecord] = []
    for _, h in site.roles:
        f = site.transfer_trace(h)
        if f.exists():
            log = read_connector_log(f)
            p_recs += [(t, h) for t in log.transfers]
            received += log.received
    # at TP > 1 a request is one flow per (P rank, D rank): each P record meets its D rank's
    by_flow = received_by_flow(received)
    return [Push(t, h, by_flow.get((t.transfer_id, t.rank, t.peer_rank))) for t, h in p_recs]


def _minus(now: dict[Any, dict[str, int]], base: dict[Any, dict[str, int]]) -> dict[Any, dict[str, int]]:
    out = {}
    for k, per in now.items():
        was = base.get(k, {})
        diff = {spine: b - was.get(spine, 0) for spine, b in per.items() if b - was.get(spine, 0) > 0}
        if diff:
            out[k] = diff
    return out


def proxy_argv(site: RunSite, engines: Engines) -> list[str]:
    cfg, fabric = site.cfg, site.fabric
    # every engine shares this machine's cores (2 here): a /health answered late is a busy
    # engine, not a dead one, and with one instance per pool a probe timing out twice
    # would take the pool out of rotation and fail requests (a dead engine still leaves
    # rotation at once: its refused connections count as failed probes)
    argv = [sys.executable, "-m", "kvpath.cli", "proxy", "--host", fabric.MGMT_ROOT_IP, "--port", str(PROXY_PORT),
            "--first-byte-timeout-s", str(cfg.timeout_s), "--policy", cfg.policy,
            "--health-timeout-s", str(HEALTH_TIMEOUT_S)]
    if cfg.pushes:
        argv += ["--mode", "push", "--reservation", "inproc", "--reservation-mode", cfg.mode,
                 "--fabric", str(site.spec_file), "--kernel-oracle", fabric.prefix, "--dc-delay-s", str(cfg.dc_delay_s),
                 "--kv-bytes-per-token", str(engines.kv_bytes_per_token()), "--lease-s", "60",
                 "--reserve-at", cfg.reserve_at, "--cc-metric", cfg.cc_metric,
                 "--reservation-token-file", str(site.token_file)]  # the file's path: the token never in argv
        if cfg.engine == "emulated":  # the placement's cost model on the emulated engines' own clock and sizes
            argv += ["--placement-model", cfg.model, "--placement-accelerator", cfg.accelerator,
                     "--placement-time-scale", repr(cfg.scale_b / cfg.scale_s),
                     "--placement-push-granularity", cfg.push_granularity,
                     "--placement-layer-group", str(cfg.layer_group)]
    else:  # vLLM's in-tree connectors: D pulls (NixlConnector), or P writes (NixlPushConnector)
        argv += ["--mode", "inproc-push" if cfg.connector == "nixl-push" else "pull"]
    key_file = getattr(engines, "api_key_file", None)  # real vLLM engines run with an API key
    if key_file is not None:
        argv += ["--engine-api-key-file", str(key_file)]  # the file's path: the key itself never in argv
    return argv + site.proxy_instance_args()


def wait_in_rotation(proxy_url: str, timeout_s: float = 60.0) -> None:
    """The proxy took an engine that was still starting out of rotation: wait until its
    health probes put every instance back."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = httpx.get(f"{proxy_url}/status", timeout=10).json()
        # /status without the admin token names instances by role and position, not URL
        down = [i.get("url") or f"{role} #{i['index']}" for role in ("prefill", "decode") for i in st[role]
                if not i["healthy"]]
        if not down:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy still has {down} out of rotation after {timeout_s:.0f} s")
        time.sleep(0.5)
