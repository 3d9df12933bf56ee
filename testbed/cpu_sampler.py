"""The machine's CPU once a second, in a thread, while a run's client measures: its idle
share, and (given how to tell a child process's part by its command line) the share of the
machine each part of the run used, so that a saturated machine can be told apart: by the
engines, or by someone else.

The testbed's workload driver (:mod:`kvpath.testbed.driver`) samples the idle share alone;
``benchmarks/serve_compare.py`` splits it into its parts too.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

# what the machine's busy time is split into: the engines, the proxy, the client that
# measures (the sampling process itself, and the bench processes it starts), and "others"
CPU_PARTS = ("engines", "proxy", "bench", "others")


@dataclass(frozen=True)
class CpuSample:
    at: float  # the end of its second
    idle: float  # % of the machine (all cores) idle
    # % of the machine each part used: this comparison's engines, proxy and bench client
    # (with this script), and "others": busy outside this script's process tree (other
    # tenants' work, and the kernel's softirq work of the fabric). Empty when the sampler
    # was given no way to tell the parts apart.
    parts: dict[str, float] = field(default_factory=dict)
    # the engines' threads' time runnable but waiting for a CPU (/proc/<pid>/task/*/schedstat),
    # in seconds per second: how many engine threads wanted a core and had none, on average
    engines_wait: float = 0.0

    @property
    def others(self) -> float:
        return self.parts.get("others", 0.0)


def _wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have been runnable but not running (schedstat's second field)."""
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return 0.0
    return total / 1e9


class CpuSampler:
    """Once a second, in a thread: the machine's CPU idle, and with ``part_of`` (a direct
    child's command line -> its part, one of ``CPU_PARTS`` but "others") the share of the
    machine each part used: the child and its descendants count as its part, this process
    as "bench", everything outside this process's tree as "others"."""

    def __init__(self, part_of: Callable[[list[str]], str] | None = None) -> None:
        self.samples: list[CpuSample] = []
        self._part_of = part_of
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree_cpu_s(self) -> dict[int, tuple[str, float, float]]:
        """pid -> (part, CPU seconds so far, run-queue wait seconds so far) for this process
        and every descendant (the wait is read for the engines only); empty without ``part_of``."""
        out: dict[int, tuple[str, float, float]] = {}
        if self._part_of is None:
            return out
        me = psutil.Process()
        try:
            t = me.cpu_times()
            out[me.pid] = ("bench", t.user + t.system, 0.0)
            for child in me.children():
                try:
                    part = self._part_of(child.cmdline())
                    for p in [child, *child.children(recursive=True)]:
                        t = p.cpu_times()
                        out[p.pid] = (part, t.user + t.system, _wait_s(p.pid) if part == "engines" else 0.0)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def _run(self) -> None:
        cores = psutil.cpu_count() or 1
        last = self._tree_cpu_s()
        while not self._stop.is_set():
            t0 = time.monotonic()
            idle = psutil.cpu_times_percent(interval=1.0).idle
            if self._part_of is None:
                self.samples.append(CpuSample(time.time(), idle))
                continue
            now = self._tree_cpu_s()
            scale = 100.0 / ((time.monotonic() - t0) * cores)
            parts = dict.fromkeys(CPU_PARTS, 0.0)
            wait = 0.0
            for pid, (part, cpu_s, wait_s) in now.items():
                was = last.get(pid, (part, 0.0, 0.0))
                parts[part] += max(0.0, cpu_s - was[1]) * scale
                wait += max(0.0, wait_s - was[2]) if pid in last else 0.0
            parts["others"] = max(0.0, 100.0 - idle - sum(parts.values()))
            last = now
            self.samples.append(CpuSample(time.time(), idle, parts, wait * scale * cores / 100.0))

    def start(self) -> "CpuSampler":
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> list[CpuSample]:
        """Ends the sampling; the samples. ``wait``: once the second under way is in too (at
        most a second on); otherwise at once, those taken so far (the thread ends on its own)."""
        self._stop.set()
        if wait:
            self._thread.join(3)
        return list(self.samples)

    def __enter__(self) -> "CpuSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def between(self, start: float, end: float) -> list[CpuSample]:
        """The samples whose second ended inside [start, end] (the nearest one if none did)."""
        got = [c for c in self.samples if start <= c.at <= end + 0.5]
        if not got and self.samples:
            got = [min(self.samples, key=lambda c: abs(c.at - end))]
        return got
