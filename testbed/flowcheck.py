"""Runs bulk TCP flows with known 5-tuples across an emulated fabric and reads where
their bytes went: the fabric's own acceptance checks (kernel oracle vs counters, link
rates) for tests and benchmarks/bench_fabric.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from kvpath.oracle import KernelOracle
from kvpath.five_tuple import FiveTuple
from kvpath.testbed.counters import measured_spine, spine_flow_bytes
from kvpath.testbed.netns_fabric import NetnsFabric


@dataclass(frozen=True)
class Flow:
    src_host: str
    dst_host: str
    src_port: int
    dst_port: int


@dataclass
class FlowResult:
    flow: Flow
    five_tuple: FiveTuple
    bytes: int
    start_s: float
    end_s: float
    predicted_spine: str | None
    measured_spine: str | None

    @property
    def fct_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def mbit_s(self) -> float:
        return self.bytes * 8 / self.fct_s / 1e6


def run_flows(fabric: NetnsFabric, flows: list[Flow], nbytes: int, timeout_s: float = 60.0) -> list[FlowResult]:
    """Start every flow at once (one sender process per source host and destination,
    one receiver per destination and port) and wait for all; then compare each flow's
    kernel-predicted spine with the spine counters that carried its bytes."""
    spec = fabric.spec
    py = [sys.executable, "-m", "kvpath.testbed.flowgen"]
    servers: dict[tuple[str, int], list[Flow]] = {}
    senders: dict[tuple[str, str, int], list[Flow]] = {}
    for f in flows:
        servers.setdefault((f.dst_host, f.dst_port), []).append(f)
        senders.setdefault((f.src_host, f.dst_host, f.dst_port), []).append(f)
    procs = []
    try:
        for (dst, port), fs in servers.items():
            procs.append(subprocess.Popen(fabric.exec_argv(dst, py + [
                "serve", "--bind", spec.host_ip(dst), "--port", str(port), "--count", str(len(fs)),
                "--timeout-s", str(timeout_s)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        _wait_listening(fabric, list(servers), timeout_s)
        send_procs = []
        for (src, dst, port), fs in senders.items():
            send_procs.append(subprocess.Popen(fabric.exec_argv(src, py + [
                "send", "--dst", spec.host_ip(dst), "--port", str(port), "--bind", spec.host_ip(src),
                "--sports", ",".join(str(f.src_port) for f in fs), "--bytes", str(nbytes),
                "--timeout-s", str(timeout_s)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        procs += send_procs
        rows: dict[tuple[str, int], dict] = {}
        for p in send_procs:
            out, err = p.communicate(timeout=timeout_s + 10)
            if p.returncode != 0:
                raise RuntimeError(f"flow sender failed: {err.strip()[-500:]}")
            for line in out.splitlines():
                r = json.loads(line)
                if r:
                    rows[(r["src_ip"], r["src_port"])] = r
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    oracle = KernelOracle(spec, fabric.ns)
    predicted = oracle.paths([(f.src_host, f.dst_host, f.src_port, f.dst_port, "tcp") for f in flows])
    counts = spine_flow_bytes(fabric)
    results = []
    for f, path in zip(flows, predicted):
        ft = FiveTuple(spec.host_ip(f.src_host), spec.host_ip(f.dst_host), f.src_port, f.dst_port)
        r = rows.get((ft.src_ip, ft.src_port))
        if r is None:
            raise RuntimeError(f"flow {ft} did not finish")
        results.append(FlowResult(f, ft, r["bytes"], r["start_s"], r["end_s"], path.spine,
                                  measured_spine(counts, ft, min_bytes=nbytes // 2)))
    return results


def _wait_listening(fabric: NetnsFabric, endpoints: list[tuple[str, int]], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    for host, port in endpoints:
        while True:
            r = subprocess.run(fabric.exec_argv(host, ["ss", "-Hltn", f"sport = :{port}"]),
                               capture_output=True, text=True)
            if r.stdout.strip():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no listener on {host}:{port} after {timeout_s}s")
            time.sleep(0.05)
