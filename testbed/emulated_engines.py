"""Emulated engines as the P and D of a testbed run.

Each engine is a :mod:`kvpath.testbed.emulated_server` process in its host's namespace:
compute from the iteration-time model, real KV bytes (the model's per token, divided by
S) pushed by KVPathConnector's transfer engine over the fabric. They serve their own
per-request records at ``/kvpath/records`` and can be told to open every lane before
the run (``/kvpath/connect``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

import httpx
from rich.console import Console

from kvpath.testbed.engines import KV_PORT, API_PORT, RunSite, engine_id
from kvpath.testbed.readiness import spawn, terminate, wait_http

logger = logging.getLogger(__name__)


class EmulatedEngines:
    """One ``emulated_server`` per host (see the module's docstring); :class:`~kvpath.testbed.engines.Engines`."""

    def __init__(self, site: RunSite) -> None:
        self.site = site
        self.model_name = site.cfg.model
        self._procs: dict[str, subprocess.Popen] = {}  # host -> engine process

    def kv_bytes_per_token(self) -> int:
        from kvpath.models import kv_bytes_per_token, model_preset

        cfg = self.site.cfg
        return max(1, round(kv_bytes_per_token(model_preset(cfg.model)) / cfg.scale_s))

    def _argv(self, role: str, host: str, proxy_url: str) -> list[str]:
        site, cfg, fabric = self.site, self.site.cfg, self.site.fabric
        keys = site.control_keys(role)
        return fabric.exec_argv(host, [
            sys.executable, "-m", "kvpath.testbed.emulated_server", "--role", role, "--host", fabric.mgmt_ip(host),
            "--port", str(API_PORT), "--kv-host", fabric.spec.host_ip(host), "--kv-port", str(KV_PORT),
            "--ucx-dev", "eth0", "--model", cfg.model, "--accelerator", cfg.accelerator,
            "--scale-b", str(cfg.scale_b), "--scale-s", str(cfg.scale_s), "--lanes", str(cfg.lanes),
            "--fabric", str(site.spec_file), "--fabric-host", host, "--kernel-oracle", fabric.prefix,
            "--reservation-url", f"{proxy_url}/reservation", "--trace", str(site.transfer_trace(host)),
            "--engine-id", engine_id(role, host), "--reserve-at", cfg.reserve_at,
            "--control-key", keys["control_key"], "--control-trusted-keys", keys["control_trusted_keys"],
            "--reservation-token-file", str(site.token_file),  # the file's path: the token never in argv
            "--push-granularity", cfg.push_granularity, "--layer-group", str(cfg.layer_group),
            "--uplink-pushes", str(cfg.uplink_pushes), "--push-order", cfg.push_order,
            "--uplink-slots-dir", str(site.out),  # one set of slot files per emulated host, named for it
        ])

    def start(self, proxy_url: str) -> None:
        for role, h in self.site.roles:
            self._procs[h] = spawn(self._argv(role, h, proxy_url), self.site.engine_log(role, h))
        for h, proc in self._procs.items():
            wait_http(f"{self.site.url(h)}/health", proc=proc, timeout_s=120, require_200=True,
                      hint=f"see {self.site.logs}")

    def warm_up(self, proxy_url: str, console: Console) -> None:
        """Every D says Hello to every P now: P opens and registers its lanes, so every push
        of the run has lanes to choose from (the first request of a pair would not)."""
        site = self.site
        peers = [f"{site.fabric.spec.host_ip(h)}:{KV_PORT}" for h in site.p_hosts]
        for h in site.d_hosts:
            r = httpx.post(f"{site.url(h)}/kvpath/connect", json={"peers": peers}, timeout=30)
            r.raise_for_status()
        deadline = time.monotonic() + 120
        while True:
            known = httpx.get(f"{proxy_url}/reservation/v1/state", headers=site.admin_headers(),
                              timeout=10).json()["lanes_known"]
            n = sum(len(ws) for ws in known.values())
            if n >= site.pairs:
                console.log(f"lanes open and registered for all {site.pairs} P-D pairs")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {n} of {site.pairs} P-D pairs registered lanes in 120 s")
            time.sleep(0.5)

    def settle(self, client: list[dict[str, Any]], timeout_s: float = 30.0) -> None:
        """Wait until every engine's KV blocks are free again (pushes released)."""
        deadline = time.monotonic() + timeout_s
        for h in self._procs:
            while time.monotonic() < deadline:
                if httpx.get(f"{self.site.url(h)}/kvpath/records", timeout=10).json()["kv_usage"] == 0:
                    break
                time.sleep(0.2)

    def records(self) -> dict[str, dict[str, Any]]:
        return {h: httpx.get(f"{self.site.url(h)}/kvpath/records", timeout=30).json() for h in self._procs}

    def decode_only(self, client: list[dict[str, Any]], workload: Any) -> None:
        return None  # emulated engines make no real text to compare

    def kv_loss(self) -> None:
        return None  # KVPathConnector's failed pushes are in its own records

    def stop(self) -> None:
        terminate(list(self._procs.values()))
