"""Reservation service benchmark: decisions per second in-process and over HTTP, and the
joint placement's decision time beside cc's and ecmp's.

    .venv/bin/python benchmarks/bench_reservation.py [--decisions 50000] [--repeats 5] [--http-requests 2000]
        [--joint 2000]

In-process: reserve+release pairs on an 8 leaves x 8 spines x 8 hosts fabric with 8
lanes per P host and a few hundred flows kept active (target >= 20,000 decisions/s in
cc). Each mode runs --repeats times; the table gives the median (min..max) per second
of the process's CPU time and of wall time. On a machine shared with other work the
wall rate swings with the load; the CPU rate is what the code costs.
Over HTTP: a `kvpath reservation` server in its own process (its token in the
environment, never on its command line), its pairs' lanes registered first, a client
keeping 8 requests in flight as the proxy asks (no lanes named); p50/p99 latency of
/v1/reserve.
Joint placement (kvpath/reservation/placer.py): 16 P engines (on leaves 0-1) x 16 D
engines (on leaves 4-5) x 8 lanes per pair, random queues and in-flight counts, about
256 flows kept reserved; per decision, the time of ``place`` (joint, network, load) and
of a cc and an ecmp ``reserve`` for the same pair, interleaved request by request (A B
C ...), so that noise hits them alike; p50 and p99 of each, and joint's p99 over cc's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.placement import CostModel, EngineState
from kvpath.reservation.decisions import MODES, LaneInfo, ReservationService
from kvpath.reservation.placer import place
from kvpath.reservation.wire import TOKEN_ENV as RESERVATION_TOKEN_ENV
from kvpath.testbed.readiness import free_port, wait_http

SPEC = FabricSpec(leaves=8, spines=8, hosts_per_leaf=8)


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    hosts = SPEC.hosts()
    pairs = []
    for _ in range(n):
        s = rng.choice(hosts)
        d = rng.choice([h for h in hosts if h[:2] != s[:2]])
        pairs.append((s, d, rng.randint(10**6, 10**9)))
    return pairs


def baseline_service(rev: str):
    """The ReservationService class of commit ``rev`` (its decisions.py loaded beside
    today's, on today's other modules): old and new code in one run."""
    import importlib.util
    import tempfile

    src = subprocess.run(["git", "show", f"{rev}:kvpath/reservation/decisions.py"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent).stdout
    path = Path(tempfile.mkdtemp()) / "decisions_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kvpath_reservation_decisions_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.ReservationService


def run_once(mode: str, pairs: list, cls=ReservationService) -> tuple[float, float]:
    """One fresh service making len(pairs) decisions: (per CPU second, per wall second)."""
    n = len(pairs)
    svc = cls(SPEC, mode, dc_delay_s=0.001)
    lanes = [LaneInfo(i, 40000 + 17 * i, 0) for i in range(8)]
    for s, d, _ in pairs[:2000]:
        svc.register_lanes(s, d, lanes)
    active: list[str] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (s, d, b) in enumerate(pairs):
        active.append(svc.reserve(s, d, b, lanes, f"t{i}").lease_id)
        if len(active) > 256:  # keep a few hundred flows in the fabric
            svc.release(active.pop(0))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for lid in active:
        svc.release(lid)
    assert svc.state()["reserved_flows"] == 0
    return n / cpu, n / wall


def bench_inprocess(n: int, repeats: int, baseline: str = "") -> dict[str, dict[str, list[float]]]:
    """Per mode (and per mode of ``baseline``'s code, as "<mode> @<rev>"), the decision
    rates of every repeat; they interleave (ecmp cc dc ecmp@old cc@old ...) so that a burst
    of load elsewhere hits all of them alike."""
    pairs = workload(n)
    kinds = [(m, ReservationService) for m in MODES]
    if baseline:
        old = baseline_service(baseline)
        kinds += [(f"{m} @{baseline}", old) for m in MODES]
    out: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k, _ in kinds}
    for _ in range(repeats):
        for name, cls in kinds:
            cpu, wall = run_once(name.split()[0], pairs, cls)
            out[name]["cpu"].append(cpu)
            out[name]["wall"].append(wall)
    return out


def bench_joint(n: int, seed: int = 3) -> dict[str, np.ndarray]:
    """Per-decision seconds of each kind (see the module), n decisions each, interleaved."""
    rng = random.Random(seed)
    p_hosts = [f"l{leaf}h{h}" for leaf in (0, 1) for h in range(8)]
    d_hosts = [f"l{leaf}h{h}" for leaf in (4, 5) for h in range(8)]
    lanes = [LaneInfo(i, 40000 + 17 * i, 0) for i in range(8)]
    cost = CostModel(SPEC, IterationTimeModel.preset())
    svcs = {k: ReservationService(SPEC, "ecmp" if k == "ecmp" else "cc") for k in ("joint", "network", "load", "cc",
                                                                                     "ecmp")}
    for svc in svcs.values():
        for p in p_hosts:
            for d in d_hosts:
                svc.register_lanes(p, d, lanes)
    active: dict[str, list[str]] = {k: [] for k in svcs}
    out: dict[str, list[float]] = {k: [] for k in svcs}
    warm = 200  # untimed: every pair's lane candidates computed once (the service caches them)
    for i in range(n + warm):
        ps = [EngineState(f"p{k}", h, rng.randint(0, 6), rng.randint(0, 30_000)) for k, h in enumerate(p_hosts)]
        ds = [EngineState(f"d{k}", h, rng.randint(0, 6)) for k, h in enumerate(d_hosts)]
        tokens = rng.randint(100, 6000)
        nbytes = tokens * 131072
        s, d = rng.choice(p_hosts), rng.choice(d_hosts)
        for k, svc in svcs.items():
            t = time.perf_counter()
            if k in ("cc", "ecmp"):
                lid = svc.reserve(s, d, nbytes, transfer_id=f"t{i}").lease_id
            else:
                lid = place(svc, cost, ps, ds, tokens, nbytes, transfer_id=f"t{i}", policy=k).reservation.lease_id
            if i >= warm:
                out[k].append(time.perf_counter() - t)
            active[k].append(lid)
            if len(active[k]) > 256:
                svc.release(active[k].pop(0))
    return {k: np.array(v) for k, v in out.items()}


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):,.0f} ({min(v):,.0f}..{max(v):,.0f})"


async def _http(url: str, n: int, conc: int, token: str, client: str = "aiohttp",
                rate: float = 0.0, server: "psutil.Process | None" = None) -> tuple[list[float], float, float, float]:
    """``n`` reserve+release pairs, at most ``conc`` in flight, on keep-alive connections:
    aiohttp (its client costs a fraction of httpx's CPU, which shares these cores with the
    service) or httpx. ``rate``: pairs start at this many per second (open loop, as a
    proxy tier's admissions arrive), else each as soon as one ends (closed loop: the
    latency is then the concurrency over the throughput). Open loop, a reserve's latency
    counts from when it was due, so time queued behind the 64 in flight counts too.
    Returns the latencies, and the measured phase's wall time and CPU time of the client
    and of the ``server`` process (not the registrations' or the warm-up's)."""
    pairs = workload(n, seed=1)
    lanes = [{"lane": i, "src_port": 40000 + 17 * i} for i in range(8)]
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    hdr = {"Authorization": f"Bearer {token}"}
    if client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc), headers=hdr)

        async def post(path: str, body: dict) -> dict:
            async with session.post(url + path, json=body) as r:
                r.raise_for_status()
                return await r.json()
    else:
        session = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=conc), headers=hdr)

        async def post(path: str, body: dict) -> dict:
            r = await session.post(url + path, json=body)
            r.raise_for_status()
            return r.json()
    try:
        for s, d in sorted({(s, d) for s, d, _ in pairs}):  # as P's connectors do (not timed)
            await post("/v1/lanes", {"src_host": s, "dst_host": d, "lanes": lanes})

        async def one(i, s, d, b, due=None):
            try:
                t = time.perf_counter() if due is None else due
                got = await post("/v1/reserve", {"src_host": s, "dst_host": d, "bytes": b, "transfer_id": f"h{i}"})
                lat.append(time.perf_counter() - t)
                await post("/v1/release", {"lease_id": got["lease_id"]})
            finally:
                sem.release()

        failed: list[asyncio.Task] = []
        tasks: set[asyncio.Task] = set()

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if task.cancelled() or task.exception() is not None:
                failed.append(task)

        async def run(todo, t_start=None):
            # one dispatcher: a pair's task is made when it is due (open loop) and a slot
            # of the ``conc`` is free, so at most ``conc`` tasks live (not thousands of
            # sleeping ones for the collector and the timer heap to walk)
            for i, (s, d, b) in enumerate(todo):
                due = None
                if t_start is not None:
                    due = t_start + i / rate
                    wait = due - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                await sem.acquire()
                task = asyncio.create_task(one(i, s, d, b, due))
                tasks.add(task)
                task.add_done_callback(done)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

        await run(pairs[:50])  # warm-up
        lat.clear()
        s0 = sum(server.cpu_times()[:2]) if server else 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        await run(pairs, t0 if rate else None)
        if failed or len(lat) != len(pairs):
            raise SystemExit(f"{len(failed)} of {len(pairs)} reserve+release pairs failed: "
                             f"{failed[0].exception() if failed else 'answers missing'}")
        elapsed, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        server_cpu = sum(server.cpu_times()[:2]) - s0 if server else 0.0
    finally:
        await (session.close() if client == "aiohttp" else session.aclose())
    return lat, elapsed, client_cpu, server_cpu


def bench_http(n: int, conc: int, client: str = "aiohttp", rate: float = 0.0) -> dict:
    import json
    import tempfile

    port = free_port()
    spec_file = Path(tempfile.mkdtemp()) / "fabric.json"
    spec_file.write_text(json.dumps(SPEC.to_dict()))
    token = secrets.token_urlsafe(24)
    proc = subprocess.Popen([sys.executable, "-m", "kvpath.cli", "reservation", "--port", str(port), "--mode", "cc",
                             "--fabric", str(spec_file)], env={**os.environ, RESERVATION_TOKEN_ENV: token})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout_s=30, interval_s=0.1)
        server = psutil.Process(proc.pid)
        # the load client's own heap (the in-process runs' services, the workload) set
        # aside: a full collection of it would stall the client, and open loop that stall
        # counts in every reserve due meanwhile
        gc.collect()
        gc.freeze()
        lat, el, client_cpu, server_cpu = asyncio.run(_http(url, n, conc, token, client, rate, server))
    finally:
        proc.terminate()
        proc.wait(10)
    a = np.array(lat) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "rps": n / el,
            # CPU per reserve+release pair: the load client's (it shares the cores) and the service's
            "client_cpu_ms": client_cpu * 1e3 / n, "server_cpu_ms": server_cpu * 1e3 / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=50000)
    ap.add_argument("--repeats", type=int, default=5, help="in-process runs per mode (median and range)")
    ap.add_argument("--http-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--http-client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the load client over HTTP (it shares the cores with the service)")
    ap.add_argument("--http-rate", type=float, default=0.0,
                    help="reserve+release pairs started per second, open loop (0: closed loop, as fast as they end)")
    ap.add_argument("--joint", type=int, default=2000, help="joint placement decisions to time (0: skip)")
    ap.add_argument("--baseline", default="", help="a git commit: its decision code runs beside today's, interleaved")
    args = ap.parse_args()
    con = Console()
    if args.joint:
        jt = bench_joint(args.joint)
        t = Table(title=f"one decision, us ({args.joint} each, interleaved; joint/network/load over 16 P x 16 D x 8 "
                        f"lanes, cc and ecmp over one pair's 8 lanes)")
        for c in ("decision", "p50", "p99", "mean"):
            t.add_column(c)
        for k, v in jt.items():
            t.add_row(k, f"{np.percentile(v, 50) * 1e6:.0f}", f"{np.percentile(v, 99) * 1e6:.0f}",
                      f"{v.mean() * 1e6:.0f}")
        con.print(t)
        ratio = np.percentile(jt["joint"], 99) / np.percentile(jt["cc"], 99)
        con.print(f"joint p99 / cc p99: {ratio:.1f}x (goal <= 3x: {'yes' if ratio <= 3 else 'NO'})")
    ip = bench_inprocess(args.decisions, args.repeats, args.baseline)
    t = Table(title=f"in-process decisions/s ({SPEC.leaves}x{SPEC.spines}x{SPEC.hosts_per_leaf} fabric, 8 lanes, "
                    f"~256 active flows; median (min..max) of {args.repeats})")
    t.add_column("mode")
    t.add_column("per CPU second")
    t.add_column("per wall second")
    for k, v in ip.items():
        t.add_row(k, spread(v["cpu"]), spread(v["wall"]))
    con.print(t)
    for conc in args.concurrency:
        h = bench_http(args.http_requests, conc, args.http_client, args.http_rate)
        pace = f"{args.http_rate:g}/s offered, " if args.http_rate else ""
        con.print(f"HTTP /v1/reserve (cc, {pace}at most {conc} in flight, {args.http_client}): p50 {h['p50_ms']:.2f} ms, "
                  f"p99 {h['p99_ms']:.2f} ms, {h['rps']:,.0f} reserve+release pairs/s; CPU per pair: service "
                  f"{h['server_cpu_ms']:.2f} ms, load client {h['client_cpu_ms']:.2f} ms")
    cc = statistics.median(ip["cc"]["cpu"])
    con.print(f"[bold]summary[/bold]: in-process cc {cc:,.0f}/CPU s (>= 20,000: {'yes' if cc >= 20000 else 'NO'})")
    if args.baseline:
        old = statistics.median(ip[f"cc @{args.baseline}"]["cpu"])
        con.print(f"cc today over cc @{args.baseline}: {cc / old:.2f}x per CPU second (goal >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
