"""Proxy overhead: latency added by `kvpath proxy` against stub engines.

    .venv/bin/python benchmarks/bench_proxy.py [--streams 1 64 512] [--rounds 3] [--pin] [--plot PNG]
                                               [--reservation inproc|none] [--engines N]
                                               [--policies least_outstanding joint]

Stub P and D engines (testbed/stub_engine.py) and the proxy each run in their own
process; an aiohttp client keeps N streaming requests open at once, their start times
spread over one request's duration so that they stay out of phase. For each N,
rounds straight to the stub D and through the proxy (push mode, both legs) alternate.
Each proxied request also reserves a lane (and releases it) in the reservation
service running inside the proxy (``--reservation inproc``; 8 lanes registered for
the P->D host pair), so the overhead includes the reservation;
the table gives time to first byte, what the proxy adds (the p99 gap per round, its
median the headline; target < 5 ms at 64 streams) and the proxy's own CPU time per
request, a number that does not depend on how busy the machine is. With ``--policies A
B`` one proxy per policy serves the same stubs (``--engines`` N P and N D, lanes
registered for every host pair), rounds rotating direct, A, B; the summary gives B's p99
over A's per round (joint against least outstanding: the cost of placing P, D and the lane
at once, in the proxy's in-process service). With ``--pin`` the
proxy runs alone on the last core. On 2 cores the client and the stubs share the CPU
with the proxy, so at 512 streams the machine saturates and the direct path slows too:
the table gives the machine's lowest idle share over the direct and over the proxied
rounds (near 0: the machine, not the proxy, set the queue)."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import uvloop
from rich.console import Console
from rich.progress import track as progress
from rich.table import Table

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.proxy.instances import PLACED_POLICIES, POLICIES
from kvpath.reservation import wire
from kvpath.testbed.readiness import free_port, terminate, wait_http

LANES = 8

STUB = """
import uvicorn
from kvpath.testbed.stub_engine import StubBehaviour, create_stub_app
b = StubBehaviour(delay_s={delay}, token_delay_s={tok}, keep_records=False)
uvicorn.run(create_stub_app({name!r}, b), host="127.0.0.1", port={port}, log_level="warning", backlog=4096)
"""


async def run_streams(url: str, n_streams: int, per_stream: int, tokens: int,
                      spread_s: float = 0.0) -> tuple[list[float], list[float], int]:
    """N clients, each sending ``per_stream`` streamed requests back to back.

    aiohttp, not httpx: at hundreds of streams httpx's own pool bookkeeping costs
    more CPU than the proxy under test, on the same 2 cores."""
    ttfb: list[float] = []
    e2e: list[float] = []
    errors = 0
    body = {"model": "tiny", "prompt": "spine leaf lane path push pull proxy fabric", "max_tokens": tokens, "stream": True}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as c:
        async def stream(k: int) -> None:
            nonlocal errors
            # Start times spread over one request's duration: the streams then stay
            # out of phase, as independent clients are, instead of arriving in bursts.
            await asyncio.sleep(spread_s * k / n_streams)
            for _ in range(per_stream):
                t0 = time.perf_counter()
                first = None
                try:
                    async with c.post(url + "/v1/completions", json=body) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            continue
                        got = []
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter() - t0
                            got.append(chunk)
                        if b"".join(got).count(b"data: [DONE]") != 1:  # a lost or doubled answer
                            errors += 1
                            continue
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    errors += 1
                    continue
                e2e.append(time.perf_counter() - t0)
                ttfb.append(first or 0.0)

        await asyncio.gather(*(stream(k) for k in range(n_streams)))
    return ttfb, e2e, errors


def cpu_s(procs: list[psutil.Process]) -> float:
    """CPU time of the proxy: its processes (its workers too) and, with --workers, its
    reservation service's (which a single proxy runs in process)."""
    return cpu_split_s(procs)[0]


def cpu_split_s(procs: list[psutil.Process]) -> tuple[float, float]:
    """(CPU seconds, of them kernel (system) seconds) of ``procs`` and their children."""
    total = kernel = 0.0
    for p in procs:
        for q in (p, *p.children(recursive=True)):
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
            kernel += t.system
    return total, kernel


def idle_pct(since: "psutil._common.scputimes") -> float:
    """The machine's idle share (all cores) since ``since``: near 0, the machine, not the
    proxy, was the bottleneck (the stubs and the client share its cores)."""
    now = psutil.cpu_times()
    busy = sum(now) - sum(since)
    return 100.0 * ((now.idle + getattr(now, "iowait", 0)) - (since.idle + getattr(since, "iowait", 0))) / max(busy, 1e-9)


def plot_ttfb(samples: dict[int, tuple[list[float], list[float]]], path: str, title: str) -> None:
    """One panel per stream count: the distribution (CDF) of time to first byte,
    straight to the stub and through the proxy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(samples), figsize=(4.5 * len(samples), 3.6), squeeze=False)
    for ax, (n, (direct, proxied)) in zip(axes[0], samples.items()):
        for data, label in ((direct, "direct to D"), (proxied, "through the proxy")):
            x = np.sort(np.array(data) * 1e3)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
        ax.set_title(f"{n} streams")
        ax.set_xlabel("time to first byte (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def register_lanes(res_url: str, token: str, p_hosts: list[str], d_hosts: list[str]) -> None:
    """Lanes for every P->D host pair, as P's connectors register them: without them
    every reservation would be a quick 'no_lanes' fallback, not a decision."""
    async with aiohttp.ClientSession() as c:
        for src in p_hosts:
            for dst in d_hosts:
                body = wire.LanesRequest(src_host=src, dst_host=dst,
                                         lanes=[wire.LaneInfo(i, 41000 + i) for i in range(LANES)])
                async with c.post(res_url + wire.LANES_PATH, data=wire.encode(body),
                                  headers={"Authorization": f"Bearer {token}", "content-type": "application/json"}) as r:
                    if r.status != 200:
                        raise SystemExit(f"registering lanes failed: {r.status} {await r.text()}")


async def reservation_counts(px_url: str, res_url: str, token: str) -> tuple[int, int]:
    """(reservations decided, fallbacks) so far, from the service and the proxy (the
    service's reads need the token)."""
    async with aiohttp.ClientSession() as c:
        async with c.get(res_url + wire.STATE_PATH, headers={"Authorization": f"Bearer {token}"}) as r:
            decided = (await r.json())["counters"].get("reservations", 0)
        async with c.get(px_url + "/metrics") as r:
            text = await r.text()
    fallbacks = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("kvpath_proxy_reservation_fallbacks_total{"))
    return decided, int(fallbacks)


def pct(a: list[float], q: float) -> float:
    return float(np.percentile(np.array(a) * 1e3, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--requests-per-stream", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="alternating direct/proxy rounds per stream count")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--engine-delay-s", type=float, default=0.2, help="stub time before the first token (prefill)")
    ap.add_argument("--token-delay-s", type=float, default=0.01, help="stub time between tokens (decode)")
    ap.add_argument("--plot", default="runs/bench_proxy.png", help="where to save the TTFB CDFs ('' for none)")
    ap.add_argument("--reservation", choices=("inproc", "none"), default="inproc",
                    help="inproc: each proxied request reserves a lane in the proxy's reservation service")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=["round_robin"],
                    help="one proxy per policy over the same stubs, their rounds interleaved with the direct ones "
                         "(joint and network place P, D and the lane in the proxy's reservation service)")
    ap.add_argument("--engines", type=int, default=1, help="stub P engines and stub D engines, each")
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="this code's proxies run as N processes (kvpath proxy --workers N), each such proxy with its "
                         "own `kvpath reservation` process (what --reservation inproc is in one process; their CPU "
                         "per request counts both); several values: one proxy each, rounds interleaved")
    ap.add_argument("--compare-site", metavar="DIR", action="append", default=[],
                    help="also run each policy's proxy from the kvpath installed in DIR (`pip install --no-deps "
                         "--target DIR <checkout of another commit>`), its rounds interleaved with this code's: "
                         "old code and new side by side (repeatable)")
    ap.add_argument("--pin", action="store_true",
                    help="give the proxy the last core to itself (on 2 cores this starves the client and stubs)")
    args = ap.parse_args()
    if args.reservation == "none" and any(p in PLACED_POLICIES for p in args.policies):
        ap.error("--policies joint/network place in the reservation service: they need --reservation inproc")
    if not 1 <= args.engines <= 16:
        ap.error("--engines must be in [1, 16]")
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cores) >= 2
    rest, mine = (set(cores[:-1]), {cores[-1]}) if pin else (set(cores), set(cores))
    if pin:
        os.sched_setaffinity(0, rest)  # the client and (inherited) the stubs
    env = dict(os.environ)
    procs = []
    token = secrets.token_hex(8)
    res_args = ["--reservation", "inproc"] if args.reservation == "inproc" else []
    proxy_env = {**env, wire.TOKEN_ENV: token}  # the reservation service's token: never in argv
    p_hosts, d_hosts = [f"l0h{i}" for i in range(args.engines)], [f"l1h{i}" for i in range(args.engines)]
    try:
        engines: dict[str, list[str]] = {"P": [], "D": []}
        for role, hosts in (("P", p_hosts), ("D", d_hosts)):
            for k, _ in enumerate(hosts):
                port = free_port()
                code = STUB.format(delay=args.engine_delay_s, tok=args.token_delay_s, name=f"{role}{k}", port=port)
                procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
                engines[role].append(f"http://127.0.0.1:{port}")
        # tp=1 given: no worker of a multi-worker proxy sends its first P leg alone to learn it
        prefill = [f"{u},kv_addr=127.0.0.1:{KV_SIDE_CHANNEL_PORT + k},fabric_host={h},tp=1"
                   for k, (u, h) in enumerate(zip(engines["P"], p_hosts))]
        decode = [f"{u},fabric_host={h}" for u, h in zip(engines["D"], d_hosts)]
        proxies: dict[str, tuple[str, list[psutil.Process]]] = {}
        res_of: dict[str, str] = {}  # proxy label -> its reservation service's URL
        variants = [(None, w) for w in args.workers] + [(site, 1) for site in args.compare_site]
        for site, workers in variants:
            for policy in args.policies:
                port = free_port()
                extra, served = list(res_args), []
                label = f"{policy}@{Path(site).name}" if site else (
                    f"{policy} x{workers}" if workers > 1 else policy)
                res_of[label] = f"http://127.0.0.1:{port}/reservation"
                if workers > 1 and args.reservation == "inproc":
                    # one service for this proxy's workers (in-process, each would decide alone)
                    res_port = free_port()
                    procs.append(subprocess.Popen([sys.executable, "-m", "kvpath.cli", "reservation", "--port",
                                                   str(res_port), "--mode", "cc"], env=proxy_env))
                    res_of[label] = f"http://127.0.0.1:{res_port}"
                    wait_http(res_of[label] + "/health")
                    served.append(psutil.Process(procs[-1].pid))
                    extra = ["--reservation-url", res_of[label]]
                if workers > 1:
                    extra += ["--workers", str(workers)]
                # another commit's kvpath: its directory first on the path, started outside
                # this checkout (whose kvpath/ the working directory would otherwise put first)
                site_env = {**proxy_env, "PYTHONPATH": str(Path(site).resolve())} if site else proxy_env
                procs.append(subprocess.Popen(
                    ["taskset", "-c", ",".join(map(str, sorted(mine)))] * pin +
                    [sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port", str(port),
                     "--policy", policy, *[a for u in prefill for a in ("--prefill", u)],
                     *[a for u in decode for a in ("--decode", u)], *extra], env=site_env,
                    cwd="/" if site else None))
                # taskset execs, so the pid is the proxy's
                proxies[label] = (f"http://127.0.0.1:{port}", [psutil.Process(procs[-1].pid), *served])
        d_url = engines["D"][0]
        for u in [*engines["P"], *engines["D"], *(px + "/health" for px, _ in proxies.values())]:
            wait_http(u)
        if args.reservation == "inproc":
            for label in proxies:
                uvloop.run(register_lanes(res_of[label], token, p_hosts, d_hosts))
        con = Console(width=170)
        t = Table(title=f"proxy overhead{' (proxy on its own core)' if pin else ''}, {args.engines}P{args.engines}D "
                        f"stub engines ({args.engine_delay_s * 1e3:.0f} ms to first token, "
                        f"{args.tokens} tokens {args.token_delay_s * 1e3:.0f} ms apart), "
                        f"reservation: {args.reservation}, "
                        f"{args.requests_per_stream} requests per stream per round, {args.rounds} rounds")
        for col in ("streams", "policy", "direct TTFB p50/p99 ms", "proxy TTFB p50/p99 ms", "added p50 ms",
                    "added p99 ms: median (range) of rounds", "added e2e p99 ms", "proxy CPU ms/request",
                    "machine idle % direct/proxy", "errors direct/proxy"):
            t.add_column(col)
        results: dict[tuple[int, str], float] = {}
        cpu: dict[tuple[int, str], float] = {}
        first = next(iter(proxies))
        gaps: dict[tuple[int, str], list[float]] = {}  # per round: p99 over the first policy's p99
        samples: dict[int, tuple[list[float], list[float]]] = {}
        for n in args.streams:
            for px, _ in proxies.values():
                uvloop.run(run_streams(px, min(n, 8), 1, args.tokens))  # warm connections
            spread = args.engine_delay_s + args.tokens * args.token_delay_s
            d_t, d_e, d_err, d_idle = [], [], 0, []
            got = {pol: {"t": [], "e": [], "err": 0, "cpu": 0.0, "add99": [], "idle": []} for pol in proxies}
            # Direct and proxied rounds alternate (the policies' order rotating), so slow
            # phases of this shared machine hit all of them; the headline is the median
            # of the rounds' p99 gaps.
            for r in progress(range(args.rounds), f"{n} streams"):
                i0 = psutil.cpu_times()
                dt, de, derr = uvloop.run(run_streams(d_url, n, args.requests_per_stream, args.tokens, spread))
                d_idle.append(idle_pct(i0))
                d_t += dt
                d_e += de
                d_err += derr
                order = list(proxies)[r % len(proxies):] + list(proxies)[:r % len(proxies)]
                p99 = {}
                for pol in order:
                    px, proc = proxies[pol]
                    c0, i0 = cpu_s(proc), psutil.cpu_times()
                    pt, pe, perr = uvloop.run(run_streams(px, n, args.requests_per_stream, args.tokens, spread))
                    g = got[pol]
                    g["idle"].append(idle_pct(i0))
                    g["cpu"] += cpu_s(proc) - c0
                    g["add99"].append(pct(pt, 99) - pct(dt, 99))
                    g["t"] += pt
                    g["e"] += pe
                    g["err"] += perr
                    p99[pol] = pct(pt, 99)
                for pol in proxies:
                    gaps.setdefault((n, pol), []).append(p99[pol] - p99[first])
            for pol, g in got.items():
                cpu_per_req = g["cpu"] * 1e3 / max(1, len(g["e"]))
                cpu[(n, pol)] = cpu_per_req
                add50, add99 = pct(g["t"], 50) - pct(d_t, 50), float(np.median(g["add99"]))
                results[(n, pol)] = add99
                t.add_row(str(n), pol, f"{pct(d_t, 50):.1f} / {pct(d_t, 99):.1f}",
                          f"{pct(g['t'], 50):.1f} / {pct(g['t'], 99):.1f}", f"{add50:.1f}",
                          f"{add99:.1f} ({min(g['add99']):.1f}..{max(g['add99']):.1f})",
                          f"{pct(g['e'], 99) - pct(d_e, 99):.1f}", f"{cpu_per_req:.2f}",
                          f"{min(d_idle):.0f}/{min(g['idle']):.0f}", f"{d_err}/{g['err']}")
            samples[n] = (d_t, got[first]["t"])
        con.print(t)
        if args.reservation == "inproc":
            for pol, (px, _) in proxies.items():
                decided, fallbacks = uvloop.run(reservation_counts(px, res_of[pol], token))
                con.print(f"{pol}: reservations decided in the proxied path: {decided}, fallbacks: {fallbacks}")
        if args.plot:
            plot_ttfb(samples, args.plot, t.title or "")
            con.print(f"plot: {args.plot}")
        for pol in proxies:
            if (64, pol) in results:
                con.print(f"[bold]summary[/bold] {pol}: p99 added at 64 streams {results[(64, pol)]:.1f} ms "
                          f"(< 5 ms: {'yes' if results[(64, pol)] < 5 else 'NO'})")
        for pol in list(proxies)[1:]:
            if (64, pol) in gaps:
                g = gaps[(64, pol)]
                con.print(f"[bold]summary[/bold] {pol} against {first} at 64 streams, p99 per round: "
                          f"median {np.median(g):+.2f} ms ({min(g):+.2f}..{max(g):+.2f}); proxy CPU per request "
                          f"{cpu[(64, pol)]:.2f} against {cpu[(64, first)]:.2f} ms "
                          f"({cpu[(64, pol)] / cpu[(64, first)]:.2f}x)")
    finally:
        terminate(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
