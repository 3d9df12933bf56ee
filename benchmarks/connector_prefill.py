"""Section 2 of bench_connector.py: P's prefill throughput (an emulated engine thread) with pushes
in flight vs none, split with the engine thread's schedstat into GIL waits, CPU waits, steal
and on-CPU time.

Imported by bench_connector.py (kvpath installed, see scripts/setup.sh), which sets the UCX and
BLAS environment before numpy is imported.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.sender import PushSender
from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers
from connector_common import (
    CONTROL_KNOBS,
    LANES,
    REGIONS,
    _instrument,
    _record_sink,
    _wait_registrations,
    fmt_bytes,
    med,
    ms,
    pct,
    plan_push,
)


# -- 2. P's prefill throughput with pushes in flight -------------------------------------
def sched(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one of our threads."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on, wait, _ = f.read().split()
    return int(on) / 1e9, int(wait) / 1e9


def steal_s(cpu: int | None) -> float:
    """Hypervisor steal time so far, seconds: of one CPU, or the mean over all CPUs. With
    CONFIG_PARAVIRT_TIME_ACCOUNTING the scheduler counts it neither as on-CPU nor as waiting."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    name = "cpu" if cpu is None else f"cpu{cpu}"
    fields = next(line.split() for line in lines if line.split()[0] == name)
    n = 1 if cpu is not None else sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") / max(1, n)


def busy_s() -> float:
    """CPU seconds all processes on this machine used so far (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")


class PrefillWork:
    """A fixed CPU-bound step standing in for the engine thread's prefill: per layer a
    BLAS matmul and elementwise ops on 64 x 256 float32 (numpy drops the GIL inside these
    kernels), then Python glue and small numpy ops (which hold it), like a model forward
    on CPU plus the scheduler's bookkeeping."""

    def __init__(self, layers: int = 8, tokens: int = 64, hidden: int = 256, glue: int = 700):
        rng = np.random.default_rng(0)
        self.x0 = rng.standard_normal((tokens, hidden), dtype=np.float32)
        self.ws = [rng.standard_normal((hidden, hidden), dtype=np.float32) / np.float32(math.sqrt(hidden))
                   for _ in range(layers)]
        self.glue = glue
        self.t_np = self.t_py = 0.0

    def _kernels(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        y = x @ w
        np.tanh(y, out=y)
        y += x
        return y

    def _glue(self, x: np.ndarray) -> int:
        d: dict[int, int] = {}
        for k in range(self.glue):
            d[k & 31] = d.get(k & 31, 0) + k
        row = x[-1, :64]
        return len(d) + int(np.argmax(row)) + int(row.sum() > 0)

    def step(self, timed: bool = False) -> int:
        x, acc = self.x0, 0
        for w in self.ws:
            if timed:
                t0 = time.perf_counter()
                x = self._kernels(x, w)
                t1 = time.perf_counter()
                acc += self._glue(x)
                self.t_np += t1 - t0
                self.t_py += time.perf_counter() - t1
            else:
                x = self._kernels(x, w)
                acc += self._glue(x)
        return acc


def histogram(vals: list[float], edges_ms: tuple = (0.25, 0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 15, 20)) -> str:
    counts = [0] * (len(edges_ms) + 1)
    for v in vals:
        counts[sum(v * 1e3 >= e for e in edges_ms)] += 1
    labels = [f"{a:g}-{b:g}" for a, b in zip((0,) + edges_ms, edges_ms)] + [f">{edges_ms[-1]:g}"]
    return ", ".join(f"{lab}: {c}" for lab, c in zip(labels, counts) if c)


def pin(d_pid: int) -> tuple[int, set[int]] | None:
    """The engine thread (this one) on a CPU of its own; every other thread of ours and all of
    D's on the others, as if D ran on another machine and P's writer had its own core.
    None when there is only one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    main_cpu, others = cpus[0], set(cpus[1:])
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, {main_cpu} if tid == me else others)
    for tid in map(int, os.listdir(f"/proc/{d_pid}/task")):
        os.sched_setaffinity(tid, others)
    return main_cpu, others


def unpin(cpus: set[int]) -> None:
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def bench_prefill(console: Console, rounds: int, window_s: float, push_mib: float, depth: int,
                  samples: bool = False, pinned: bool = True) -> dict:
    blen, nb, nbytes = plan_push(push_mib)
    spec = BufferSpec(regions=REGIONS, num_blocks=nb, block_len=blen, block_size=16)
    d_spec = BufferSpec(regions=REGIONS, num_blocks=nb * depth, block_len=blen, block_size=16)
    cfg = KVPathConfig(lanes=LANES, side_channel_port=6400, ucx_net_devices="lo", lease_timeout_s=30,
                       registration_timeout_s=60, **CONTROL_KNOBS)
    bufs = make_buffers(spec, "random", seed=3)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    sender = PushSender(cfg, layout_from_buffers(spans, nb, 16), spans).start()
    recs = _record_sink(sender)
    xfer: dict = {}
    for agent in sender.lanes.agents:
        _instrument(agent, xfer)
    src = list(range(nb))
    dst = [list(range(j * nb, (j + 1) * nb)) for j in range(depth)]
    work = PrefillWork()
    for _ in range(20):
        work.step()
    for _ in range(100):
        work.step(timed=True)
    step_s, np_share = (work.t_np + work.t_py) / 100, work.t_np / (work.t_np + work.t_py)
    main_tid, writer_tid = threading.get_native_id(), sender.native_id
    seq = iter(range(1 << 30))
    res: dict = {"off": [], "on": []}
    lat: dict = {"hand": [], "wire": []}
    placed: tuple[int, set[int]] | None = None
    with PeerProcess(cfg, d_spec) as d:
        dproc, me = psutil.Process(d.proc.pid), psutil.Process()

        def register_batch(n: int) -> list[str]:
            base = sender.stats.snapshot()["registrations"]
            tids = [f"s{next(seq)}" for _ in range(n)]
            for k, tid in enumerate(tids):
                d.q_in.put(("register", f"d{tid}", tid, sender.address, dst[k % depth], 0))
            for _ in tids:
                d.get(60)
            _wait_registrations(sender, base + n)
            return tids

        def window(stream: bool, n_reg: int) -> dict:
            tids = register_batch(n_reg) if stream else []
            time.sleep(0.05)
            sub_at: dict[str, float] = {}
            inflight: set[str] = set()
            nxt = steps = 0
            cpu = placed[0] if placed is not None else None
            s0, w0, d0, st0 = sched(main_tid), sched(writer_tid)[0], sum(dproc.cpu_times()[:2]), steal_s(cpu)
            b0, p0 = busy_s(), sum(me.cpu_times()[:2])
            wall0 = time.time()
            t0 = time.perf_counter()
            end = t0 + window_s
            while True:
                work.step()
                steps += 1
                fin = sender.take_finished()  # the engine's once-per-step hand-back
                if stream:
                    inflight -= fin
                    while len(inflight) < depth and nxt < len(tids):
                        tid = tids[nxt]
                        sub_at[tid] = time.time()
                        sender.submit_finished(f"p{tid}", tid, src, lane=nxt % LANES)
                        inflight.add(f"p{tid}")
                        nxt += 1
                now = time.perf_counter()
                if now >= end:
                    break
            el = now - t0
            wall1 = wall0 + el
            s1, w1, d1, st1 = sched(main_tid), sched(writer_tid)[0], sum(dproc.cpu_times()[:2]), steal_s(cpu)
            b1, p1 = busy_s(), sum(me.cpu_times()[:2])
            starved = stream and nxt >= len(tids)
            left = tids[nxt:]
            for tid in left:  # the registrations not used: D cancels them, P drops them
                d.q_in.put(("cancel", f"d{tid}"))
            for _ in left:
                d.get(60)
            if tids:
                d.call("wait", [f"d{t}" for t in tids], 60)
                deadline = time.monotonic() + 10
                while any(t not in recs for t in tids[:nxt]) and time.monotonic() < deadline:
                    time.sleep(0.001)
            sender.take_finished()
            off = time.time() - time.monotonic()
            busy = pushes = 0.0
            spans_in: list[tuple[float, float]] = []
            for tid in tids[:nxt]:
                r = recs.pop(tid, None)
                if r is None or r.status != "ok":
                    continue
                a, b = max(sub_at[tid], wall0), min(r.completed_at, wall1)
                if b > a:
                    spans_in.append((a, b))
                if r.completed_at <= wall1:
                    pushes += 1
                done_at = xfer.pop(tid, {}).get("done")
                if stream and done_at is not None:
                    lat["hand"].append(r.submit_at - sub_at[tid])
                    lat["wire"].append(done_at - (r.submit_at - off))
            for tid in tids[nxt:]:
                recs.pop(tid, None)
                xfer.pop(tid, None)
            spans_in.sort()  # union of the in-flight intervals
            cur_a = cur_b = None
            for a, b in spans_in:
                if cur_b is None or a > cur_b:
                    if cur_b is not None:
                        busy += cur_b - cur_a
                    cur_a, cur_b = a, b
                else:
                    cur_b = max(cur_b, b)
            if cur_b is not None:
                busy += cur_b - cur_a
            on_cpu, rq, steal = s1[0] - s0[0], s1[1] - s0[1], st1 - st0
            blocked = max(0.0, el - on_cpu - rq - steal)
            return {"rate": steps / el, "steps": steps, "el": el, "on_cpu": on_cpu / el, "runq": rq / el,
                    "blocked": blocked / el, "steal": steal / el,
                    "per_step": (on_cpu / steps, rq / steps, blocked / steps, steal / steps),
                    "writer": (w1 - w0) / el, "d_cpu": (d1 - d0) / el,
                    "others": max(0.0, (b1 - b0) - (p1 - p0) - (d1 - d0)) / el, "pushes": pushes / el, "busy": busy / el,
                    "starved": starved, "submitted": nxt}

        # warm-up (not counted): opens the lanes and measures how many pushes a window takes
        warm = window(True, 64 + int(window_s * 1000))
        lat["hand"].clear()
        lat["wire"].clear()
        n_reg = int(warm["submitted"] * 1.5) + depth + 8
        all_cpus = os.sched_getaffinity(0)
        placed = pin(d.proc.pid) if pinned else None
        try:
            # Each round runs a no-push window twice (A/A): how far two identical windows
            # differ is this machine's noise floor, printed beside the slowdown.
            orders = (("off", "on", "aa"), ("on", "aa", "off"), ("aa", "off", "on"))
            for i in range(rounds):
                for kind in orders[i % 3]:
                    res.setdefault(kind, []).append(window(kind == "on", n_reg))
        finally:
            if placed is not None:
                unpin(all_cpus)
    sender.close()
    off, on, aa = res["off"], res["on"], res["aa"]
    slowdown = [100 * (1 - b["rate"] / a["rate"]) for a, b in zip(off, on)]
    noise = [100 * (1 - b["rate"] / a["rate"]) for a, b in zip(off, aa)]

    def col(rows: list[dict], key: str, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
        v = [r[key] * scale for r in rows]
        return f"{fmt.format(med(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"

    t = Table(title=f"2. P's prefill throughput (emulated engine thread) with {fmt_bytes(nbytes)} pushes streaming vs "
                    f"none: median (min-max) of {rounds} alternating {window_s:.1f} s windows each")
    t.add_column("")
    t.add_column("no pushes")
    t.add_column(f"{fmt_bytes(nbytes)} pushes, {depth} in flight")
    t.add_column("no pushes again (A/A)")
    t.add_row("prefill steps / s", col(off, "rate", 1), col(on, "rate", 1), col(aa, "rate", 1))
    t.add_row("engine thread on a CPU, ms per s", col(off, "on_cpu"), col(on, "on_cpu"), col(aa, "on_cpu"))
    t.add_row("engine thread runnable, waiting for a CPU, ms per s", col(off, "runq"), col(on, "runq"), col(aa, "runq"))
    t.add_row("engine thread blocked (waiting for the GIL), ms per s", col(off, "blocked"), col(on, "blocked"), col(aa, "blocked"))
    t.add_row("hypervisor steal on its CPU, ms per s (10 ms ticks)", col(off, "steal"), col(on, "steal"), col(aa, "steal"))
    t.add_row("writer thread CPU, % of a core", col(off, "writer", 100), col(on, "writer", 100), col(aa, "writer", 100))
    t.add_row("D process CPU (same machine here), % of a core", col(off, "d_cpu", 100), col(on, "d_cpu", 100), col(aa, "d_cpu", 100))
    t.add_row("everything else on this machine (other processes, kernel), % of a core", col(off, "others", 100),
              col(on, "others", 100), col(aa, "others", 100))
    t.add_row("pushes completed / s", "-", col(on, "pushes", 1, "{:.0f}") +
              f"\n= {med([r['pushes'] for r in on]) * nbytes / 1e9:.2f} GB/s")
    t.add_row("time with a push in flight, %", "-", col(on, "busy", 100))
    if lat["hand"]:
        for key, label in (("hand", "push: submit_finished -> writer prepares the WRITE, ms"),
                           ("wire", "push: WRITE prepared -> DONE at P (check_xfer_state), ms")):
            v = lat[key]
            t.add_row(label + "\n(median / p90 / max)", "-", f"{ms(med(v))} / {ms(pct(v, 0.9))} / {ms(max(v))}")
    console.print(t)
    per = {k: [[r["per_step"][i] for r in rows] for i in range(4)] for k, rows in (("off", off), ("on", on))}
    delta = [med(per["on"][i]) - med(per["off"][i]) for i in range(4)]
    sd = med(slowdown)
    gil_pct = 100 * delta[2] * med([r["rate"] for r in off])
    where = (f"engine thread pinned to CPU {placed[0]}; the writer, D's process and the rest of ours on CPU "
             f"{','.join(map(str, sorted(placed[1])))} (as if D ran elsewhere)" if placed is not None
             else "threads not pinned: D's process competes for the same CPUs")
    console.print(
        f"  the step: {step_s * 1e3:.2f} ms alone, {100 * np_share:.0f}% of it in numpy kernels that drop the GIL "
        f"(8 x [64x256 @ 256x256 matmul, tanh, add]), the rest Python glue and small numpy ops holding it. "
        f"Between steps the engine thread calls take_finished() and tops the pushes up to {depth} in flight. "
        f"Placement: {where}."
    )
    console.print(
        f"  prefill slowdown with pushes in flight: [bold]{sd:.1f}%[/bold] ({min(slowdown):.1f} to {max(slowdown):.1f}%) "
        f"(target < 3%: {'yes' if sd < 3 else '[red]NO[/red]'}); per step the engine thread gained "
        f"{delta[2] * 1e6:+.0f} us blocked (GIL), {delta[1] * 1e6:+.0f} us waiting for a CPU, "
        f"{delta[0] * 1e6:+.0f} us on a CPU, {delta[3] * 1e6:+.0f} us stolen by the hypervisor; the GIL waits alone cost {gil_pct:.1f}% of a step. "
        f"A/A (the no-push window run twice): {med(noise):+.1f}% ({min(noise):+.1f} to {max(noise):+.1f}%), this machine's "
        f"noise floor: a slowdown inside it is not resolved here"
        + ("; [red]the push stream ran dry in some windows[/red]" if any(r["starved"] for r in on) else "")
    )
    if samples and lat["hand"]:
        for key in ("hand", "wire"):
            console.print(f"  section 2 push {key} (ms bins: count): {histogram(lat[key])}", soft_wrap=True)
    return {"slowdown": sd, "slowdown_range": (min(slowdown), max(slowdown)), "delta_us": [x * 1e6 for x in delta],
            "gil_pct": gil_pct, "aa": med(noise), "aa_range": (min(noise), max(noise))}
