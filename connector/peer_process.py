"""A D-side transfer engine in a child process, driven over a queue.

Used by the two-process NIXL tests and by ``benchmarks/bench_connector.py`` so
that pushes really cross a process (and a UCX TCP connection), without vLLM.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from connector.config import KVPathConfig


@dataclass
class BufferSpec:
    regions: int = 4
    num_blocks: int = 128
    block_len: int = 4096
    block_size: int = 16


def make_buffers(spec: BufferSpec, fill: str = "zeros", seed: int = 0) -> list[np.ndarray]:
    if fill == "random":
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 256, spec.num_blocks * spec.block_len, dtype=np.uint8) for _ in range(spec.regions)]
    return [np.zeros(spec.num_blocks * spec.block_len, dtype=np.uint8) for _ in range(spec.regions)]


def _serve(cfg: KVPathConfig, spec: BufferSpec, q_in: mp.Queue, q_out: mp.Queue) -> None:
    from connector.layout import layout_from_buffers
    from connector.receiver import PushReceiver

    logging.basicConfig(level=logging.INFO, format="D %(levelname)s %(name)s: %(message)s")
    bufs = make_buffers(spec)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, spec.num_blocks, spec.block_size)
    rx = PushReceiver(cfg, lay, spans).start()
    done: set[str] = set()
    failed: set[str] = set()
    q_out.put(("ready", rx.engine_id))
    while True:
        cmd, *args = q_in.get()
        if cmd == "register":
            rx.register(*args)
            q_out.put(("ok",))
        elif cmd == "cancel":
            rx.cancel(args[0])
            q_out.put(("ok",))
        elif cmd == "wait":  # until all given request ids ended, or timeout
            want, timeout = set(args[0]), args[1]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                f, x = rx.take()
                done |= f
                failed |= x
                if want <= done:
                    break
                time.sleep(0.002)
            q_out.put(("result", sorted(done & want), sorted(failed & want)))
        elif cmd == "read":
            blocks = args[0]
            q_out.put(("data", [b.reshape(spec.num_blocks, spec.block_len)[blocks].tobytes() for b in bufs]))
        elif cmd == "info":  # for raw-NIXL baselines: D's agent metadata and layout
            q_out.put(("info", rx.agent.get_agent_metadata(), rx.agent.name, lay))
        elif cmd == "stats":
            q_out.put(("stats", rx.stats.snapshot()))
        elif cmd == "stop":
            rx.close()
            q_out.put(("bye",))
            return


class PeerProcess:
    """Start with ``with PeerProcess(cfg, spec) as d: d.call("register", ...)``."""

    def __init__(self, cfg: KVPathConfig, spec: BufferSpec):
        ctx = mp.get_context("spawn")
        self.q_in: mp.Queue = ctx.Queue()
        self.q_out: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(cfg, spec, self.q_in, self.q_out), daemon=True)
        self.spec = spec

    def __enter__(self) -> "PeerProcess":
        self.proc.start()
        self.engine_id = self._get(60)[1]
        return self

    def _get(self, timeout: float) -> tuple[Any, ...]:
        return self.q_out.get(timeout=timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60) -> tuple[Any, ...]:
        self.q_in.put((cmd, *args))
        return self._get(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def __exit__(self, *exc: Any) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
