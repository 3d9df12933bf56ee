"""Connector benchmark: engine push vs raw NIXL WRITE, descriptors, idle CPU.

    .venv/bin/python benchmarks/bench_connector.py [--mib 64] [--reps 8] [--idle-s 5]

Prints, in one run on this machine:
  1. push throughput through PushSender (submit -> blocks released on P, D
     registered first) vs a raw NIXL WRITE of the same bytes to the same D
     process, as a ratio (target >= 0.9);
  2. NIXL descriptors per transfer for contiguous vs randomly fragmented blocks,
     with and without coalescing;
  3. the writer and receiver threads' CPU use while idle (target < 5% of a core).
Pushes cross a UCX TCP connection on loopback (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from connector.config import KVPathConfig  # noqa: E402
from connector.layout import build_descs, layout_from_buffers  # noqa: E402
from connector.messages import make_notif  # noqa: E402
from connector.nixl_io import make_agent, register  # noqa: E402
from connector.peer_process import BufferSpec, PeerProcess, make_buffers  # noqa: E402
from connector.receiver import PushReceiver  # noqa: E402
from connector.sender import PushSender  # noqa: E402


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
    med = statistics.median
    out.update(engine_gbps=nbytes / med(engine_s) / 1e9, wire_gbps=nbytes / med(wire_s) / 1e9,
               raw_gbps=nbytes / med(raw_s) / 1e9, byte_exact=ok)
    out["ratio"] = out["engine_gbps"] / out["raw_gbps"]
    t = Table(title=f"1. push throughput, {nbytes / 2**20:.0f} MiB per push, median of {reps} (UCX TCP, loopback)")
    for c in ("path", "GB/s", "ms / push"):
        t.add_column(c)
    t.add_row("kvpath engine (prefill handed over -> push done)", f"{out['engine_gbps']:.2f}", f"{med(engine_s) * 1e3:.1f}")
    t.add_row("kvpath engine (WRITE posted -> done)", f"{out['wire_gbps']:.2f}", f"{med(wire_s) * 1e3:.1f}")
    t.add_row("raw NIXL WRITE, tight poll", f"{out['raw_gbps']:.2f}", f"{med(raw_s) * 1e3:.1f}")
    console.print(t)
    console.print(f"engine / raw = [bold]{out['ratio']:.2f}[/bold] (target >= 0.9); bytes exact: {ok}")
    return out


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
    t = Table(title=f"2. NIXL descriptors for one push of {n} blocks x {len(lay.regions)} regions")
    t.add_column("blocks")
    t.add_column("descriptors")
    for k, v in rows.items():
        t.add_row(k, str(v))
    console.print(t)
    return rows


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
    t = Table(title=f"3. engine threads' CPU while idle ({idle_s:.0f} s, idle_poll_s={cfg.idle_poll_s})")
    t.add_column("thread")
    t.add_column("% of a core")
    for k, v in res.items():
        t.add_row(k, f"{v:.2f}")
    console.print(t)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="bytes per push, MiB")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=5.0)
    args = ap.parse_args()
    console = Console()
    tp = bench_throughput(console, args.mib, args.reps)
    bench_descriptors(console)
    idle = bench_idle_cpu(console, args.idle_s)
    console.print(
        f"[bold]summary[/bold]: engine/raw throughput {tp['ratio']:.2f} (>= 0.9: {'yes' if tp['ratio'] >= 0.9 else 'NO'}), "
        f"idle CPU writer {idle['writer (P)']:.2f}% receiver {idle['receiver (D)']:.2f}% (< 5%: "
        f"{'yes' if max(idle.values()) < 5 else 'NO'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
