"""Connector benchmark: push latency and throughput vs raw NIXL, P's prefill slowdown, descriptors, idle CPU.

    .venv/bin/python benchmarks/bench_connector.py [--sizes 0.25,4,64] [--reps 24] [--prefill-rounds 12]
                                                   [--mib 64] [--idle-s 5] [--sections 1,2,3,4,5,6,7] [--samples]
                                                   [--control curve|plaintext] [--security-reps 3]
                                                   [--verify-reps 4] [--verify-rounds 8] [--verify-mib 0.25]

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
  5. the writer and receiver threads' CPU use while idle (target < 2% of a core);
  6. what the control channel's security costs: small-push latency and idle CPU with
     CURVE keys and with loopback plaintext, alternating, --security-reps times each
     (budget: latency up by at most 10%, idle CPU under 1% of a core);
  7. what kv_verify costs: small-push latency with kv_verify off and all, alternating,
     --verify-reps times each (benchmarks/bench_kv_verify.py: the hashes and the cost per MiB).
Sections 1-5 run with CURVE keys made for the run (--control plaintext: without).
Pushes cross a UCX TCP connection on loopback (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp")
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # the emulated engine thread is one thread: no BLAS pool

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvpath.connector.config import KVPathConfig  # noqa: E402
from kvpath.connector.layout import build_descs, layout_from_buffers  # noqa: E402
from kvpath.connector.messages import make_notif  # noqa: E402
from kvpath.connector.nixl_io import make_agent, register  # noqa: E402
from kvpath.connector.receiver import PushReceiver  # noqa: E402
from kvpath.connector.sender import PushSender  # noqa: E402
from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers  # noqa: E402
from connector_common import CONTROL_KNOBS, fmt_bytes, med, med_range, set_control  # noqa: E402
from connector_latency import _latency_one, bench_latency  # noqa: E402
from connector_prefill import bench_prefill  # noqa: E402

# Sections 1 and 2 live in connector_latency.py and connector_prefill.py, their shared helpers in
# connector_common.py; sections 3-5, the options and the summary here.


# -- 3. push throughput -----------------------------------------------------------------
def bench_throughput(console: Console, mib: int, reps: int) -> dict:
    blen = 256 * 1024
    nb = max(8, mib * 1024 * 1024 // (4 * blen))
    spec = BufferSpec(regions=4, num_blocks=nb, block_len=blen, block_size=16)
    cfg = KVPathConfig(lanes=1, side_channel_port=6100, ucx_net_devices="lo", lease_timeout_s=30, registration_timeout_s=60,
                       **CONTROL_KNOBS)
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


def bench_idle_cpu(console: Console, idle_s: float, port: int = 6200) -> dict:
    cfg = KVPathConfig(lanes=4, side_channel_port=port, ucx_net_devices="lo", **CONTROL_KNOBS)
    buf = np.zeros(64 * 4096, dtype=np.uint8)
    spans = [(buf.ctypes.data, buf.nbytes)]
    lay = layout_from_buffers(spans, 64, 16)
    s = PushSender(cfg, lay, spans).start()
    r = PushReceiver(cfg, lay, spans).start()
    # an idle pair as in service: D connected to P (handshake and lanes done), nothing held
    r.connect(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while not any(link.welcomed for link in list(r.links.by_addr.values())):
        if time.monotonic() > deadline:
            s.close()
            r.close()
            raise RuntimeError("idle benchmark: D's handshake with P did not complete in 30 s")
        time.sleep(0.05)
    time.sleep(1.5)  # past the threads' linger (LINGER_S): measure them dormant
    proc = psutil.Process()

    def cpu(tid: int) -> float:
        for th in proc.threads():
            if th.id == tid:
                return th.user_time + th.system_time
        return 0.0

    def total() -> float:  # every thread of the process: ZMQ's I/O and ZAP threads, UCX's, ours
        t = proc.cpu_times()
        return t.user + t.system

    ids = {"writer (P)": s.native_id, "receiver (D)": r.native_id}
    c0 = {k: cpu(v) for k, v in ids.items()}
    p0 = total()
    t0 = time.perf_counter()
    time.sleep(idle_s)
    el = time.perf_counter() - t0
    res = {k: 100 * (cpu(v) - c0[k]) / el for k, v in ids.items()}
    whole = 100 * (total() - p0) / el
    s.close()
    r.close()
    t = Table(title=f"5. engine threads' CPU while idle ({idle_s:.0f} s, idle_poll_s={cfg.idle_poll_s}; "
                    f"target < {IDLE_TARGET:g}% of a core)")
    t.add_column("thread")
    t.add_column("% of a core")
    for k, v in res.items():
        t.add_row(k, f"{v:.2f}")
    t.add_row("whole process (P and D, this benchmark's main thread asleep)", f"{whole:.2f}")
    console.print(t)
    return {**res, "whole process": whole}


# -- 6. what the control channel's security costs ---------------------------------------------
SECURITY_LATENCY_BUDGET = 1.10  # CURVE / plaintext, small pushes
SECURITY_IDLE_BUDGET = 1.0  # % of a core


def bench_security(console: Console, reps: int, rounds: int, idle_s: float) -> dict:
    """Small-push latency (D saw the notification, 1 at a time and 16 at once) and idle CPU,
    CURVE vs plaintext, alternating so drift hits both alike."""
    keep = dict(CONTROL_KNOBS)
    res: dict = {m: {"lat1": [], "lat16": [], "idle": [], "whole": []} for m in ("plaintext", "curve")}
    try:
        for i in range(reps):
            for mode in (("plaintext", "curve") if i % 2 == 0 else ("curve", "plaintext")):
                set_control(mode)
                port = 6500 + 20 * (2 * i + (mode == "curve"))
                r = _latency_one(0.25, rounds, port)
                res[mode]["lat1"].append(med(r["rounds"][("engine", 1)]["d"]))
                res[mode]["lat16"].append(med(r["rounds"][("engine", 16)]["d"]))
                idle = bench_idle_cpu(Console(quiet=True), idle_s, port + 10)
                res[mode]["idle"].append(max(idle["writer (P)"], idle["receiver (D)"]))
                res[mode]["whole"].append(idle["whole process"])
    finally:
        CONTROL_KNOBS.clear()
        CONTROL_KNOBS.update(keep)
    t = Table(title=f"6. the control channel's security: 256 KiB pushes ({rounds} rounds) and idle CPU ({idle_s:.0f} s), "
                    f"median (min-max) over {reps} alternating runs")
    for c in ("control channel", "latency 1 at a time, ms", "latency 16 at once, ms", "idle CPU, max thread, % core",
              "idle CPU, whole process (P+D), % core"):
        t.add_column(c)
    for mode, r in res.items():
        idle = f"{med(r['idle']):.2f} ({min(r['idle']):.2f}-{max(r['idle']):.2f})"
        whole = f"{med(r['whole']):.2f} ({min(r['whole']):.2f}-{max(r['whole']):.2f})"
        t.add_row(mode, med_range(r["lat1"]), med_range(r["lat16"]), idle, whole)
    console.print(t)
    out = {"ratio1": med(res["curve"]["lat1"]) / med(res["plaintext"]["lat1"]),
           "ratio16": med(res["curve"]["lat16"]) / med(res["plaintext"]["lat16"]),
           "idle_curve": max(res["curve"]["idle"]), "res": res}
    console.print(f"  CURVE / plaintext latency: 1 at a time {out['ratio1']:.2f}, 16 at once {out['ratio16']:.2f} "
                  f"(budget <= {SECURITY_LATENCY_BUDGET}); idle CPU with CURVE at most {out['idle_curve']:.2f}% "
                  f"(budget < {SECURITY_IDLE_BUDGET}%). The ZAP thread (pyzmq's authenticator) blocks in poll and "
                  "is not counted; it wakes only when a peer connects.")
    return out


# -- 7. what kv_verify costs a push ----------------------------------------------------------
def bench_kv_verify(console: Console, reps: int, rounds: int, mib: float) -> dict:
    """Small-push latency (D saw the notification, 1 at a time and 16 at once) with
    kv_verify off and all, alternating (off, all, all, off, ...) so drift hits both alike."""
    res: dict = {m: {"lat1": [], "lat16": []} for m in ("off", "all")}
    for i in range(reps):
        for mode in (("off", "all") if i % 2 == 0 else ("all", "off")):
            port = 6900 + 20 * (2 * i + (mode == "all"))
            r = _latency_one(mib, rounds, port, kv_verify=mode)
            if r["bad"] or not r["exact"]:
                raise RuntimeError(f"kv_verify={mode}: rounds failed or bytes differ: {r['bad'][:3]}")
            res[mode]["lat1"].append(med(r["rounds"][("engine", 1)]["d"]))
            res[mode]["lat16"].append(med(r["rounds"][("engine", 16)]["d"]))
    t = Table(title=f"7. kv_verify off vs all: {fmt_bytes(r['bytes'])} pushes ({rounds} rounds per run), D saw the "
                    f"notification, ms: median (min-max) over {reps} alternating runs")
    for c in ("kv_verify", "latency 1 at a time, ms", "latency 16 at once, ms"):
        t.add_column(c)
    for mode, v in res.items():
        t.add_row(mode, med_range(v["lat1"]), med_range(v["lat16"]))
    console.print(t)
    out = {"ratio1": med(res["all"]["lat1"]) / med(res["off"]["lat1"]),
           "ratio16": med(res["all"]["lat16"]) / med(res["off"]["lat16"]), "res": res}
    console.print(f"  kv_verify all / off latency: 1 at a time {out['ratio1']:.2f}, 16 at once {out['ratio16']:.2f} "
                  "(P hashes before it posts the WRITE, D before it reports the push received)")
    return out


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
    ap.add_argument("--sections", type=lambda v: {int(x) for x in v.split(",") if x.strip()}, default={1, 2, 3, 4, 5, 6, 7},
                    help="sections to run, e.g. 1,2 (default: all)")
    ap.add_argument("--samples", action="store_true", help="also print every push's phase times (ms, sorted)")
    ap.add_argument("--control", choices=("curve", "plaintext"), default="curve",
                    help="the control channel of sections 1-5 (default: CURVE keys made for the run)")
    ap.add_argument("--security-reps", type=int, default=3, help="section 6: alternating runs per mode")
    ap.add_argument("--security-rounds", type=int, default=8, help="section 6: latency rounds per run")
    ap.add_argument("--verify-reps", type=int, default=4, help="section 7: alternating runs per kv_verify mode")
    ap.add_argument("--verify-rounds", type=int, default=8, help="section 7: latency rounds per run")
    ap.add_argument("--verify-mib", type=float, default=0.25, help="section 7: push size, MiB")
    args = ap.parse_args()
    set_control(args.control)
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
                     f"{'yes' if pre['slowdown'] < 3 else 'NO'}; GIL waits alone {pre['gil_pct']:.1f}%; "
                     f"A/A noise {pre['aa']:+.1f}% ({pre['aa_range'][0]:+.1f} to {pre['aa_range'][1]:+.1f}%))")
    if 3 in args.sections:
        tp = bench_throughput(console, args.mib, args.reps)
        parts.append(f"throughput engine/raw {tp['ratio']:.2f} (>= 0.9: {'yes' if tp['ratio'] >= 0.9 else 'NO'})")
    if 4 in args.sections:
        bench_descriptors(console)
    if 5 in args.sections:
        idle = bench_idle_cpu(console, args.idle_s)
        parts.append(f"idle CPU writer {idle['writer (P)']:.2f}% receiver {idle['receiver (D)']:.2f}% "
                     f"(< {IDLE_TARGET:g}%: {'yes' if max(idle['writer (P)'], idle['receiver (D)']) < IDLE_TARGET else 'NO'}); "
                     f"whole process {idle['whole process']:.2f}%")
    if 6 in args.sections:
        sec = bench_security(console, args.security_reps, args.security_rounds, args.idle_s)
        ok = max(sec["ratio1"], sec["ratio16"]) <= SECURITY_LATENCY_BUDGET and sec["idle_curve"] < SECURITY_IDLE_BUDGET
        parts.append(f"security CURVE/plaintext latency {sec['ratio1']:.2f} (1) {sec['ratio16']:.2f} (16), idle "
                     f"{sec['idle_curve']:.2f}% (within budget: {'yes' if ok else 'NO'})")
    if 7 in args.sections:
        kv = bench_kv_verify(console, args.verify_reps, args.verify_rounds, args.verify_mib)
        parts.append(f"kv_verify all/off latency {kv['ratio1']:.2f} (1) {kv['ratio16']:.2f} (16)")
    console.print(f"[bold]summary[/bold] ({time.monotonic() - t_start:.0f} s): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
