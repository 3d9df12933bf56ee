"""Thin helpers around NIXL agents: creation, memory registration, probe transfers.

Agents never run NIXL's own progress thread (it busy-spins a core); the engine
threads drive progress by polling ``check_xfer_state``/``get_new_notifs``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable

import numpy as np

from kvpath.connector.config import ConfigError, KVPathConfig

logger = logging.getLogger(__name__)

PROBE_BYTES = 4096


def configure_ucx(cfg: KVPathConfig) -> None:
    """UCX reads its environment when an agent's context is created."""
    if cfg.ucx_transport != "auto":
        os.environ["UCX_TLS"] = cfg.ucx_transport
    if cfg.ucx_net_devices:
        os.environ["UCX_NET_DEVICES"] = cfg.ucx_net_devices


def load_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401
    except Exception as e:  # ImportError or a broken native library
        raise ConfigError(
            f"kv_connector KVPathConnector needs NIXL (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1): {e}"
        ) from e
    import nixl._api as api

    return api


def make_agent(name: str) -> Any:
    api = load_nixl()
    conf = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    agent = api.nixl_agent(name, conf)
    if "UCX" not in agent.backends:
        raise ConfigError("NIXL has no UCX backend on this machine; KVPathConnector needs it")
    return agent


def register(agent: Any, spans: Iterable[tuple[int, int]], mem_type: str, device_id: int = 0) -> Any:
    rows = [(addr, n, device_id, "") for addr, n in spans]
    return agent.register_memory(rows, mem_type)


def xfer_descs(agent: Any, rows: np.ndarray, mem_type: str) -> Any:
    return agent.get_xfer_descs(rows, mem_type)


def wait_xfer(agent: Any, handle: Any, timeout_s: float) -> str:
    """Drive one transfer to completion (used for the tiny lane-opening probes)."""
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state == "PROC":
        if time.monotonic() > deadline:
            return "TIMEOUT"
        time.sleep(0.0002)
        state = agent.check_xfer_state(handle)
    return state
