"""Connector benchmark: push latency and throughput vs raw NIXL, P's prefill slowdown, descriptors, idle CPU.

    .venv/bin/python benchmarks/bench_connector.py [--sizes 0.25,4,64] [--reps 24] [--prefill-rounds 12]
                                                   [--mib 64] [--idle-s 5] [--sections 1,2,3,4,5] [--samples]

Prints, in one run on this machine:
  1. push latency for each of --sizes (MiB, fractional allowed), one push at a time
     and 16 concurrent pushes over 4 lanes, through PushSender vs raw NIXL WRITEs
     with a notification of the same bytes to the same D process. Latency runs from
     ``submit_finished`` (D registered first) to D's receiver thread seeing the
     completion notification, stamped inside D (CLOCK_MONOTONIC is one clock for all
     processes); P's own view (TransferRecord) and the end-to-end time until the
     PeerProcess "wait" reply reaches the bench are shown beside it. Engine and raw
     rounds alternate. Ratio engine/raw (targets: <= 1.3x at 256 KiB, <= 1.05x at
     64 MiB), and where a push's time goes, phase by phase;
  2. P's prefill throughput with pushes in flight vs none: the engine thread is
     emulated by a fixed CPU-bound step in this process's main thread (numpy kernels
     that drop the GIL plus Python that holds it) while 4 MiB pushes stream back to
     back (2 in flight), in alternating windows. The engine thread is pinned to a CPU
     of its own, the writer and D's process to the others (--no-pin: not pinned).
     Slowdown (target < 3%), split with the engine thread's schedstat into time
     blocked (the GIL), waiting for a CPU, hypervisor steal and slower on-CPU time;
  3. push throughput through PushSender (submit -> blocks released on P) vs a raw
     NIXL WRITE of the same bytes, as a ratio (target >= 0.9);
  4. NIXL descriptors per transfer for contiguous vs randomly fragmented blocks,
     with and without coalescing;
  5. the writer and receiver threads' CPU use while idle (target < 2% of a core).
Pushes cross a UCX TCP connection on loopback (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp")
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # the emulated engine thread is one thread: no BLAS pool

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from connector.config import KVPathConfig  # noqa: E402
from connector.layout import build_descs, layout_from_buffers  # noqa: E402
from connector.messages import make_notif, parse_notif  # noqa: E402
from connector.nixl_io import make_agent, register  # noqa: E402
from connector.peer_process import BufferSpec, PeerProcess, make_buffers  # noqa: E402
from connector.receiver import PushReceiver  # noqa: E402
from connector.sender import PushSender  # noqa: E402

MiB = 1 << 20
REGIONS = 4  # KV regions (layers x K/V) in the benchmark layouts
CONC = 16  # pushes in the concurrent pattern
LANES = 4  # lanes (P agents / raw agents) the concurrent pushes spread over
SETTLE_S = 0.02  # after registering, before the push: control traffic and acks done
med = statistics.median


# -- helpers ---------------------------------------------------------------------------
def plan_push(mib: float, block_len: int = 16 * 1024) -> tuple[int, int, int]:
    """(block_len, blocks, exact bytes) for a push of ``mib`` MiB over REGIONS regions:
    16 KiB per block and region (less for a push smaller than one block), the total
    within half a block of the request."""
    target = mib * MiB
    if target < REGIONS * block_len:
        block_len = max(64, math.ceil(target / REGIONS / 64) * 64)
    nb = max(1, round(target / (REGIONS * block_len)))
    return block_len, nb, REGIONS * nb * block_len


def fmt_bytes(n: int) -> str:
    if n >= MiB:
        return f"{n // MiB} MiB" if n % MiB == 0 else f"{n / MiB:.2f} MiB"
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n / 1024:.1f} KiB"


def ms(v: float) -> str:
    return f"{v * 1e3:.2f}" if abs(v) < 0.1 else f"{v * 1e3:.1f}"


def med_range(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{ms(med(vals))} ({ms(min(vals))}-{ms(max(vals))})"


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


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


def _serve_timed(cfg: KVPathConfig, spec: BufferSpec, q_in, q_out, opts: dict) -> None:
    """PeerProcess's D loop (connector.peer_process._serve, unchanged) plus two stamps
    taken inside D: when its receiver thread saw a push's completion notification
    (ReceiverState.on_done) and when the PeerProcess loop took the release
    (ReceiverState.take). ("stamps", request_ids) returns them, as time.monotonic()."""
    from connector import peer_process, recv_state

    seen: dict[str, float] = {}
    taken: dict[str, float] = {}
    on_done, take = recv_state.ReceiverState.on_done, recv_state.ReceiverState.take

    def stamped_on_done(self, tid):
        w = on_done(self, tid)
        if w is not None:
            seen[w.request_id] = time.monotonic()
        return w

    def stamped_take(self):
        r, f = take(self)
        now = time.monotonic()
        for rid in r:
            taken[rid] = now
        return r, f

    recv_state.ReceiverState.on_done = stamped_on_done
    recv_state.ReceiverState.take = stamped_take

    class Commands:  # answers "stamps" itself; the loop sees no command then
        def get(self, timeout=None):
            item = q_in.get(timeout=timeout)
            if item[0] == "stamps":
                q_out.put(("stamps", {r: seen.pop(r, None) for r in item[1]}, {r: taken.pop(r, None) for r in item[1]}))
                raise queue.Empty
            return item

    peer_process._serve(cfg, spec, Commands(), q_out, opts)


class TimedPeer(PeerProcess):
    """A PeerProcess D that also answers ("stamps", request_ids)."""

    def __init__(self, cfg: KVPathConfig, spec: BufferSpec):
        super().__init__(cfg, spec)
        opts = {"netns": None, "compat": None, "canary": None}
        self.proc = mp.get_context("spawn").Process(
            target=_serve_timed, args=(cfg, spec, self.q_in, self.q_out, opts), daemon=True
        )

    def send(self, cmd: str, *args) -> None:
        self.q_in.put((cmd, *args))

    def recv(self, timeout: float = 60) -> tuple:
        return self._get(timeout)


def _record_sink(sender: PushSender) -> dict:
    """P's TransferRecords by transfer id, as the writer thread writes them."""
    recs: dict = {}
    orig = sender.trace.write

    def keep(r):
        recs[r.transfer_id] = r
        orig(r)

    sender.trace.write = keep
    return recs


def _instrument(agent, stamps: dict) -> None:
    """Patch one of P's lane agents (this instance only; bench side): per transfer id, when
    check_xfer_state first said DONE (time.monotonic()) and how long release_xfer_handle took."""
    tids: dict[int, str | None] = {}
    init, check, release = agent.initialize_xfer, agent.check_xfer_state, agent.release_xfer_handle

    def initialize_xfer(op, local, remote, name, notif_msg=b"", *args, **kw):
        h = init(op, local, remote, name, notif_msg, *args, **kw)
        tids[id(h)] = parse_notif(notif_msg) if notif_msg else None
        return h

    def check_xfer_state(h):
        st = check(h)
        tid = tids.get(id(h))
        if st != "PROC" and tid is not None:
            stamps.setdefault(tid, {}).setdefault("done", time.monotonic())
        return st

    def release_xfer_handle(h):
        t0 = time.monotonic()
        release(h)
        tid = tids.pop(id(h), None)
        if tid is not None:
            stamps.setdefault(tid, {})["release"] = time.monotonic() - t0

    agent.initialize_xfer, agent.check_xfer_state = initialize_xfer, check_xfer_state
    agent.release_xfer_handle = release_xfer_handle


def _wait_registrations(sender: PushSender, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sender.stats.snapshot()["registrations"] < count:
        if time.monotonic() > deadline:
            raise RuntimeError("P did not receive D's registrations")
        time.sleep(0.001)


# -- 1. push latency -------------------------------------------------------------------
PHASES = (
    ("hand", "P hand-over: submit_finished -> writer prepares the WRITE\n(raw: waiting behind the bench's earlier posts)"),
    ("wire", "P: initialize_xfer + post + progress until check_xfer_state says DONE"),
    ("rel", "P: release_xfer_handle (the TransferRecord's completed_at comes after it)"),
    ("to_d", "P saw DONE -> D's receiver thread saw the notification"),
    ("loop", "D saw it -> D's PeerProcess loop took the release"),
    ("reply", "loop took it -> bench got the 'wait' reply (per round)"),
    ("total", "total: submit -> D saw the notification"),
)


def _latency_one(mib: float, reps: int, port: int) -> dict:
    blen, nb, nbytes = plan_push(mib)
    p_spec = BufferSpec(regions=REGIONS, num_blocks=nb, block_len=blen, block_size=16)
    d_spec = BufferSpec(regions=REGIONS, num_blocks=nb * CONC, block_len=blen, block_size=16)
    cfg = KVPathConfig(lanes=LANES, side_channel_port=port, ucx_net_devices="lo", lease_timeout_s=30,
                       registration_timeout_s=60)
    bufs = make_buffers(p_spec, "random", seed=2)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, nb, 16)
    sender = PushSender(cfg, lay, spans).start()
    recs = _record_sink(sender)
    xfer: dict = {}
    for agent in sender.lane_agents:
        _instrument(agent, xfer)
    src = list(range(nb))
    dst = [list(range(j * nb, (j + 1) * nb)) for j in range(CONC)]
    kinds = [(path, n) for n in (1, CONC) for path in ("engine", "raw")]
    # per kind: per-round values and per-push phase samples
    rounds: dict = {k: {"d": [], "last": [], "p": [], "e2e": []} for k in kinds}
    phases: dict = {k: {p: [] for p, _ in PHASES} for k in kinds}
    bad: list[str] = []
    with TimedPeer(cfg, d_spec) as d:
        _, meta, _, dlay = d.call("info")
        raws = []
        for a in range(LANES):
            ag = make_agent(f"raw-{port}-{a}")
            register(ag, spans, "DRAM")
            raws.append((ag, ag.add_remote_agent(meta)))
        descs = [build_descs(lay, dlay, src, dst[j])[:2] for j in range(CONC)]

        def arm(tag: str, n: int, peer: str) -> list[str]:
            """Register n pushes on D and arm D's waiter, before the clock starts."""
            rids = [f"d-{tag}-{j}" for j in range(n)]
            for j in range(n):
                d.send("register", rids[j], f"{tag}-{j}", peer, dst[j], 0)
            for _ in range(n):
                d.recv()
            d.send("wait", rids, 120)
            return rids

        def engine_round(tag: str, n: int) -> tuple:
            base = sender.stats.snapshot()["registrations"]
            rids = arm(tag, n, sender.address)
            _wait_registrations(sender, base + n)
            time.sleep(SETTLE_S)
            t_sub = []
            for j in range(n):
                t_sub.append(time.monotonic())
                sender.submit_finished(f"p-{tag}-{j}", f"{tag}-{j}", src, lane=j % LANES)
            res = d.recv()
            t_reply = time.monotonic()
            deadline = time.monotonic() + 10
            while any(f"{tag}-{j}" not in recs for j in range(n)) and time.monotonic() < deadline:
                time.sleep(0.001)
            off = time.time() - time.monotonic()
            sender.take_finished()
            post, done_p, rel = [], [], []
            for j in range(n):
                r = recs.pop(f"{tag}-{j}", None)
                x = xfer.pop(f"{tag}-{j}", {})
                ok = r is not None and r.status == "ok"
                post.append(r.submit_at - off if ok else math.nan)
                done_p.append(x.get("done", math.nan))
                rel.append(x.get("release", math.nan))
            return rids, res, [t_sub[0]] * n, post, done_p, rel, t_reply  # all n handed over with the first

        def raw_round(tag: str, n: int) -> tuple:
            rids = arm(tag, n, "127.0.0.1:1")  # a P that never answers: D only waits for the notification
            time.sleep(SETTLE_S)
            t0, t_start, hs = time.monotonic(), [], []
            for j in range(n):  # all n prefills are handed over at t0; the bench posts them one after the other
                ag, name = raws[j % LANES]
                loc, rem = descs[j]
                t_start.append(time.monotonic())
                h = ag.initialize_xfer("WRITE", ag.get_xfer_descs(loc, "DRAM"), ag.get_xfer_descs(rem, "DRAM"), name,
                                       make_notif(f"{tag}-{j}"))
                st = ag.transfer(h)
                hs.append([ag, h, st, time.monotonic() if st != "PROC" else math.nan])
            todo = [x for x in hs if x[2] == "PROC"]
            while todo:  # tight poll, as raw NIXL without a progress thread does
                for x in todo:
                    x[2] = x[0].check_xfer_state(x[1])
                    if x[2] != "PROC":
                        x[3] = time.monotonic()
                todo = [x for x in todo if x[2] == "PROC"]
            rel = []
            for ag, h, st, _ in hs:
                t1 = time.monotonic()
                ag.release_xfer_handle(h)
                rel.append(time.monotonic() - t1)
                if st != "DONE":
                    bad.append(f"raw {tag}: {st}")
            res = d.recv()
            t_reply = time.monotonic()
            return rids, res, [t0] * n, t_start, [x[3] for x in hs], rel, t_reply

        for i in range(reps + 1):  # round 0 opens every connection and is not counted
            order = kinds if i % 2 == 0 else [kinds[1], kinds[0], kinds[3], kinds[2]]
            for path, n in order:
                tag = f"{path[0]}{n}-{i}"
                rids, res, t_sub, post, done_p, rel, t_reply = (engine_round if path == "engine" else raw_round)(tag, n)
                _, done, failed = res
                if sorted(done) != sorted(rids) or failed:
                    bad.append(f"{tag}: {len(done)}/{n} released, {len(failed)} failed")
                    continue
                _, seen, taken = d.call("stamps", rids)
                if i == 0:
                    continue
                seen_l, taken_l = [seen[r] for r in rids], [taken[r] for r in rids]
                lat = [s - t for s, t in zip(seen_l, t_sub)]
                k = (path, n)
                rounds[k]["d"].append(med(lat))
                rounds[k]["last"].append(max(seen_l) - min(t_sub))
                rounds[k]["p"].append(med([b - a for a, b in zip(post, done_p)]))
                rounds[k]["e2e"].append(t_reply - min(t_sub))
                ph = phases[k]
                for j in range(n):
                    ph["hand"].append(post[j] - t_sub[j])
                    ph["wire"].append(done_p[j] - post[j])
                    ph["rel"].append(rel[j])
                    ph["to_d"].append(seen_l[j] - done_p[j])
                    ph["loop"].append(taken_l[j] - seen_l[j])
                    ph["total"].append(lat[j])
                ph["reply"].append(t_reply - max(taken_l))
        exact = all(d.call("read", dst[j][:2])[1] == [b.reshape(nb, blen)[:2].tobytes() for b in bufs]
                    for j in (0, CONC - 1))
    sender.close()
    return {"mib": mib, "bytes": nbytes, "block_len": blen, "blocks": nb, "rounds": rounds, "phases": phases,
            "exact": exact, "bad": bad, "reps": reps}


def latency_target(nbytes: int) -> float | None:
    if nbytes <= 256 * 1024:
        return 1.3
    if nbytes >= 64 * MiB:
        return 1.05
    return None


def bench_latency(console: Console, sizes: list[float], reps: int, samples: bool) -> list[dict]:
    out = [_latency_one(mib, reps, 6300 + 10 * k) for k, mib in enumerate(sizes)]
    t = Table(title=f"1. push latency, ms: median (min-max) of {reps} rounds; engine and raw rounds alternate; "
                    f"UCX TCP on loopback; D registered first", show_lines=True)
    for c in ("push", "pattern", "path", "hand-over -> D saw\nthe notification\n(stamped in D)",
              f"last of {CONC}\nat D", "P's view: WRITE\nprepared -> DONE\n(check_xfer_state)", "end to end: bench\ngot D's 'wait' reply",
              "engine / raw"):
        t.add_column(c)
    for r in out:
        size = f"{fmt_bytes(r['bytes'])}\n{r['bytes']:,} B\n= {r['blocks']} x {REGIONS} x {r['block_len']} B"
        r["ratios"] = {}
        tgt = latency_target(r["bytes"])
        for n in (1, CONC):
            e, w = r["rounds"][("engine", n)], r["rounds"][("raw", n)]
            pattern = "1 at a time" if n == 1 else f"{CONC} at once\nover {LANES} lanes"
            ratio_cell = "-"
            if e["d"] and w["d"]:
                ratio = med(e["d"]) / med(w["d"])
                r["ratios"][n] = (ratio, tgt)
                paired = [a / b for a, b in zip(e["d"], w["d"])]
                ratio_cell = f"[bold]{ratio:.2f}[/bold]"
                if tgt is not None:
                    ratio_cell += f" (target <= {tgt}: {'yes' if ratio <= tgt else '[red]NO[/red]'})"
                ratio_cell += f"\npaired rounds {min(paired):.2f}-{max(paired):.2f}"
                if n > 1:
                    ratio_cell += f"\nlast of {CONC}: {med(e['last']) / med(w['last']):.2f}"
                ratio_cell += f"\nend to end: {med(e['e2e']) / med(w['e2e']):.2f}"
            for path, row in (("kvpath engine", e), ("raw NIXL", w)):
                t.add_row(size, pattern, path, med_range(row["d"]), med_range(row["last"]) if n > 1 else "",
                          med_range(row["p"]), med_range(row["e2e"]), ratio_cell if path == "kvpath engine" else "")
                size = pattern = ""
    console.print(t)
    console.print(
        "  hand-over: P's (first) submit_finished (engine), or the moment the bench starts posting (raw): "
        f"the {CONC} concurrent prefills count as handed over together, then are submitted or posted one by one. 'D saw': D's receiver "
        "thread got the NIXL notification (ReceiverState.on_done, stamped in D: CLOCK_MONOTONIC is one clock for all "
        f"processes). With {CONC} at once a round counts its median push; 'last' is its last notification. P's view: "
        "from the TransferRecord's submit_at (raw: before get_xfer_descs) until P's check_xfer_state first said DONE "
        "(the record's completed_at comes later, after release_xfer_handle: see 1b). End to end adds D's "
        "PeerProcess loop (2 ms queue timeout) and the reply's trip back. The ratio compares 'D saw'."
    )
    for r in out:
        if r["bad"]:
            console.print(f"  [red]{fmt_bytes(r['bytes'])}: {len(r['bad'])} rounds not counted[/red]: {r['bad'][:3]}")
        if not r["exact"]:
            console.print(f"  [red]{fmt_bytes(r['bytes'])}: bytes on D differ from P's[/red]")
    for r in out:
        t = Table(title=f"1b. where a {fmt_bytes(r['bytes'])} push's time goes, ms: median (min-max) over all pushes")
        t.add_column("phase")
        for n in (1, CONC):
            for path in ("engine", "raw"):
                t.add_column(f"{path}, {'1 at a time' if n == 1 else f'{CONC} at once'}")
        for key, label in PHASES:
            cells = []
            for n in (1, CONC):
                for path in ("engine", "raw"):
                    v = [x for x in r["phases"][(path, n)][key] if not math.isnan(x)]
                    cells.append("-" if path == "raw" and key == "hand" and n == 1 else med_range(v))
            t.add_row(label, *cells)
        console.print(t)
        if samples:
            for (path, n), ph in r["phases"].items():
                for key, _ in PHASES:
                    v = sorted(round(x * 1e3, 2) for x in ph[key] if not math.isnan(x))
                    console.print(f"  {fmt_bytes(r['bytes'])} {path} x{n} {key}: {v}", soft_wrap=True)
    return out


# -- 2. P's prefill throughput with pushes in flight -------------------------------------
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
                       registration_timeout_s=60)
    bufs = make_buffers(spec, "random", seed=3)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    sender = PushSender(cfg, layout_from_buffers(spans, nb, 16), spans).start()
    recs = _record_sink(sender)
    xfer: dict = {}
    for agent in sender.lane_agents:
        _instrument(agent, xfer)
    src = list(range(nb))
    dst = [list(range(j * nb, (j + 1) * nb)) for j in range(depth)]
    work = PrefillWork()
    for _ in range(20):
        work.step()
    for _ in range(100):
        work.step(timed=True)
    step_s, np_share = (work.t_np + work.t_py) / 100, work.t_np / (work.t_np + work.t_py)
    main_tid, writer_tid = threading.get_native_id(), sender._thread.native_id
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
                d._get(60)
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
                d._get(60)
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
            for i in range(rounds):
                for stream in ((False, True) if i % 2 == 0 else (True, False)):
                    res["on" if stream else "off"].append(window(stream, n_reg))
        finally:
            if placed is not None:
                unpin(all_cpus)
    sender.close()
    off, on = res["off"], res["on"]
    ratios = [b["rate"] / a["rate"] for a, b in zip(off, on)]
    slowdown = [100 * (1 - x) for x in ratios]

    def col(rows: list[dict], key: str, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
        v = [r[key] * scale for r in rows]
        return f"{fmt.format(med(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"

    t = Table(title=f"2. P's prefill throughput (emulated engine thread) with {fmt_bytes(nbytes)} pushes streaming vs "
                    f"none: median (min-max) of {rounds} alternating {window_s:.1f} s windows each")
    t.add_column("")
    t.add_column("no pushes")
    t.add_column(f"{fmt_bytes(nbytes)} pushes, {depth} in flight")
    t.add_row("prefill steps / s", col(off, "rate", 1), col(on, "rate", 1))
    t.add_row("engine thread on a CPU, ms per s", col(off, "on_cpu"), col(on, "on_cpu"))
    t.add_row("engine thread runnable, waiting for a CPU, ms per s", col(off, "runq"), col(on, "runq"))
    t.add_row("engine thread blocked (waiting for the GIL), ms per s", col(off, "blocked"), col(on, "blocked"))
    t.add_row("hypervisor steal on its CPU, ms per s (10 ms ticks)", col(off, "steal"), col(on, "steal"))
    t.add_row("writer thread CPU, % of a core", col(off, "writer", 100), col(on, "writer", 100))
    t.add_row("D process CPU (same machine here), % of a core", col(off, "d_cpu", 100), col(on, "d_cpu", 100))
    t.add_row("everything else on this machine (other processes, kernel), % of a core", col(off, "others", 100),
              col(on, "others", 100))
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
        f"{delta[0] * 1e6:+.0f} us on a CPU, {delta[3] * 1e6:+.0f} us stolen by the hypervisor; the GIL waits alone cost {gil_pct:.1f}% of a step"
        + ("; [red]the push stream ran dry in some windows[/red]" if any(r["starved"] for r in on) else "")
    )
    if samples and lat["hand"]:
        for key in ("hand", "wire"):
            console.print(f"  section 2 push {key} (ms bins: count): {histogram(lat[key])}", soft_wrap=True)
    return {"slowdown": sd, "slowdown_range": (min(slowdown), max(slowdown)), "delta_us": [x * 1e6 for x in delta],
            "gil_pct": gil_pct}


# -- 3. push throughput -----------------------------------------------------------------
def bench_throughput(console: Console, mib: int, reps: int) -> dict:
    blen = 256 * 1024
    nb = max(8, mib * 1024 * 1024 // (4 * blen))
    spec = BufferSpec(regions=4, num_blocks=nb, block_len=blen, block_size=16)
    cfg = KVPathConfig(lanes=1, side_channel_port=6100, ucx_net_devices="lo", lease_timeout_s=30, registration_timeout_s=60)
    bufs = make_buffers(spec, "random", seed=1)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, nb, 16)
    nbytes = 4 * nb * blen
    sender = PushSender(cfg, lay, spans).start()
    out: dict = {"bytes": nbytes}
    with PeerProcess(cfg, spec) as d:
        blocks = list(range(nb))
        engine_s, wire_s, raw_s = [], [], []
        records: list = []
        orig_write = sender.trace.write
        sender.trace.write = lambda r: (records.append(r), orig_write(r))
        # raw NIXL: one agent in this process, the same D process and memory.
        _, meta, _, dlay = d.call("info")
        raw = make_agent("raw-bench")
        register(raw, spans, "DRAM")
        name = raw.add_remote_agent(meta)
        loc, rem, _ = build_descs(lay, dlay, blocks, blocks)
        # Engine and raw pushes alternate so that both see the same machine noise;
        # round 0 opens the connections and is not counted.
        for i in range(reps + 1):
            tid = f"bench-{i}"
            d.call("register", f"d{i}", tid, sender.address, blocks, 0)
            time.sleep(0.05)  # D first: the push starts the moment P's prefill is handed over
            t_submit = time.time()
            sender.submit_finished(f"p{i}", tid, blocks)
            while f"p{i}" not in sender.take_finished():
                time.sleep(0.005)
            d.call("wait", [f"d{i}"], 30)
            if i:
                engine_s.append(records[-1].completed_at - t_submit)
                wire_s.append(records[-1].duration_s)
            # D keeps expecting a push (as it does for the engine), so it progresses UCX at the same rate.
            d.call("register", f"hold{i}", f"hold{i}", "127.0.0.1:1", [0], 0)
            l_d, r_d = raw.get_xfer_descs(loc, "DRAM"), raw.get_xfer_descs(rem, "DRAM")
            t0 = time.perf_counter()
            h = raw.initialize_xfer("WRITE", l_d, r_d, name, make_notif(f"raw-{i}"))
            st = raw.transfer(h)
            while st == "PROC":
                st = raw.check_xfer_state(h)
            t = time.perf_counter() - t0
            raw.release_xfer_handle(h)
            assert st == "DONE", st
            if i:
                raw_s.append(t)
        ok = d.call("read", blocks[:4])[1] == [b.reshape(nb, blen)[:4].tobytes() for b in bufs]
    sender.close()
    out.update(engine_gbps=nbytes / med(engine_s) / 1e9, wire_gbps=nbytes / med(wire_s) / 1e9,
               raw_gbps=nbytes / med(raw_s) / 1e9, byte_exact=ok)
    out["ratio"] = out["engine_gbps"] / out["raw_gbps"]
    t = Table(title=f"3. push throughput, {nbytes / 2**20:.0f} MiB per push, median of {reps} (UCX TCP, loopback)")
    for c in ("path", "GB/s", "ms / push"):
        t.add_column(c)
    t.add_row("kvpath engine (prefill handed over -> push done)", f"{out['engine_gbps']:.2f}", f"{med(engine_s) * 1e3:.1f}")
    t.add_row("kvpath engine (WRITE posted -> done)", f"{out['wire_gbps']:.2f}", f"{med(wire_s) * 1e3:.1f}")
    t.add_row("raw NIXL WRITE, tight poll", f"{out['raw_gbps']:.2f}", f"{med(raw_s) * 1e3:.1f}")
    console.print(t)
    console.print(f"engine / raw = [bold]{out['ratio']:.2f}[/bold] (target >= 0.9); bytes exact: {ok}")
    return out


# -- 4. descriptors ---------------------------------------------------------------------
def bench_descriptors(console: Console) -> dict:
    nb, n = 4096, 256
    lay = layout_from_buffers([((1 << 30) + i * nb * 4096, nb * 4096) for i in range(64)], nb, 16)  # 32 layers x K/V
    rng = random.Random(0)
    contiguous = list(range(100, 100 + n))
    frag_src, frag_dst = sorted(rng.sample(range(nb), n)), rng.sample(range(nb), n)
    # a partly fragmented free list: runs of 1-16 consecutive blocks at random places
    runs_src: list[int] = []
    start = 0
    while len(runs_src) < n:
        start += rng.randint(1, 40)
        k = min(rng.randint(1, 16), n - len(runs_src))
        runs_src += list(range(start, start + k))
        start += k
    rows = {
        "contiguous, coalesced": build_descs(lay, lay, contiguous, contiguous)[0].shape[0],
        "contiguous, per block": build_descs(lay, lay, contiguous, contiguous, coalesce=False)[0].shape[0],
        "runs of 1-16 blocks, coalesced": build_descs(lay, lay, runs_src, contiguous)[0].shape[0],
        "random blocks, coalesced": build_descs(lay, lay, frag_src, frag_dst)[0].shape[0],
        "random blocks, per block": build_descs(lay, lay, frag_src, frag_dst, coalesce=False)[0].shape[0],
    }
    t = Table(title=f"4. NIXL descriptors for one push of {n} blocks x {len(lay.regions)} regions")
    t.add_column("blocks")
    t.add_column("descriptors")
    for k, v in rows.items():
        t.add_row(k, str(v))
    console.print(t)
    return rows


# -- 5. idle CPU ------------------------------------------------------------------------
IDLE_TARGET = 2.0  # % of a core


def bench_idle_cpu(console: Console, idle_s: float) -> dict:
    cfg = KVPathConfig(lanes=4, side_channel_port=6200, ucx_net_devices="lo")
    buf = np.zeros(64 * 4096, dtype=np.uint8)
    spans = [(buf.ctypes.data, buf.nbytes)]
    lay = layout_from_buffers(spans, 64, 16)
    s = PushSender(cfg, lay, spans).start()
    r = PushReceiver(cfg, lay, spans).start()
    time.sleep(0.5)
    proc = psutil.Process()

    def cpu(tid: int) -> float:
        for th in proc.threads():
            if th.id == tid:
                return th.user_time + th.system_time
        return 0.0

    ids = {"writer (P)": s._thread.native_id, "receiver (D)": r._thread.native_id}
    c0 = {k: cpu(v) for k, v in ids.items()}
    t0 = time.perf_counter()
    time.sleep(idle_s)
    el = time.perf_counter() - t0
    res = {k: 100 * (cpu(v) - c0[k]) / el for k, v in ids.items()}
    s.close()
    r.close()
    t = Table(title=f"5. engine threads' CPU while idle ({idle_s:.0f} s, idle_poll_s={cfg.idle_poll_s}; "
                    f"target < {IDLE_TARGET:g}% of a core)")
    t.add_column("thread")
    t.add_column("% of a core")
    for k, v in res.items():
        t.add_row(k, f"{v:.2f}")
    console.print(t)
    return res


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes wants MiB numbers separated by commas, got {text!r}") from None
    if not sizes or any(not (s > 0 and math.isfinite(s)) for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes wants positive MiB numbers, got {text!r}")
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=parse_sizes, default=[0.25, 4.0, 64.0],
                    help="push sizes for the latency section, MiB, fractions allowed (default 0.25,4,64)")
    ap.add_argument("--reps", type=int, default=24,
                    help="counted rounds per latency pattern and path, throughput pushes per path (default 24)")
    ap.add_argument("--prefill-rounds", type=int, default=12,
                    help="alternating no-push/push window pairs for section 2 (default 12)")
    ap.add_argument("--prefill-window-s", type=float, default=0.5)
    ap.add_argument("--prefill-push-mib", type=float, default=4.0)
    ap.add_argument("--prefill-depth", type=int, default=2, help="pushes kept in flight in section 2")
    ap.add_argument("--no-pin", action="store_true",
                    help="section 2: do not pin the engine thread to a CPU of its own (D then shares its CPUs)")
    ap.add_argument("--mib", type=int, default=64, help="bytes per push for the throughput section, MiB")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--sections", type=lambda v: {int(x) for x in v.split(",") if x.strip()}, default={1, 2, 3, 4, 5},
                    help="sections to run, e.g. 1,2 (default: all)")
    ap.add_argument("--samples", action="store_true", help="also print every push's phase times (ms, sorted)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # piped: rich would wrap at 80 columns
        console = Console(width=160)
    t_start = time.monotonic()
    parts = []
    if 1 in args.sections:
        for r in bench_latency(console, args.sizes, args.reps, args.samples):
            for n, (ratio, tgt) in r["ratios"].items():
                verdict = "" if tgt is None else f" (<= {tgt}: {'yes' if ratio <= tgt else 'NO'})"
                parts.append(f"push latency {fmt_bytes(r['bytes'])} x{n} engine/raw {ratio:.2f}{verdict}")
    if 2 in args.sections:
        pre = bench_prefill(console, args.prefill_rounds, args.prefill_window_s, args.prefill_push_mib,
                            args.prefill_depth, args.samples, not args.no_pin)
        parts.append(f"prefill slowdown with pushes {pre['slowdown']:.1f}% (< 3%: "
                     f"{'yes' if pre['slowdown'] < 3 else 'NO'}; GIL waits alone {pre['gil_pct']:.1f}%)")
    if 3 in args.sections:
        tp = bench_throughput(console, args.mib, args.reps)
        parts.append(f"throughput engine/raw {tp['ratio']:.2f} (>= 0.9: {'yes' if tp['ratio'] >= 0.9 else 'NO'})")
    if 4 in args.sections:
        bench_descriptors(console)
    if 5 in args.sections:
        idle = bench_idle_cpu(console, args.idle_s)
        parts.append(f"idle CPU writer {idle['writer (P)']:.2f}% receiver {idle['receiver (D)']:.2f}% "
                     f"(< {IDLE_TARGET:g}%: {'yes' if max(idle.values()) < IDLE_TARGET else 'NO'})")
    console.print(f"[bold]summary[/bold] ({time.monotonic() - t_start:.0f} s): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
