"""kv_verify: an opt-in check that the KV a decode engine decodes from is the KV P sent
(the ``kv_verify`` knob; docs/connector-verify.md, "KV integrity check (kv_verify)").

``kv_verify`` is ``off`` (the default), ``all``, or ``sample:N``: one push in N, chosen
from the transfer id alone (:func:`selected`), so P and D pick the same pushes without
a message. For a chosen push:

- P hashes the bytes its WRITE's descriptors read, in descriptor order, from its source
  blocks (held until the WRITE ends), just before it posts the WRITE, and puts the digest
  in the completion notification, which NIXL delivers after the bytes
  (:func:`p_notif`; the wire format is :func:`encode_check`). The notification also
  says how P planned the WRITE (its TP size and rank, its block size, the tokens
  written), so that D can place P's bytes in its own blocks.
- D, when the notification comes and before the request is reported received, works out
  the destination spans of that same WRITE from its own layout and the blocks it
  registered (:func:`d_rows`: ``layout.build_descs``'s order at equal TP and block
  sizes, ``tp_map.plan``'s otherwise, so one P rank's slice of a D block is exactly the
  bytes hashed), refuses any span outside the blocks it registered for that request
  (:func:`check_inside`), hashes them in the same order and compares
  (:meth:`Verifier.check_landed`). A mismatch fails the request through the receiver's
  usual failure path, counted in ``kv_verify_mismatch``.

The hash is xxHash's XXH3-128 (``xxhash`` package): a checksum against corruption
(a bad NIC, a bug in a layout or a plan, a stray write), not a proof against a hostile P,
which could send wrong KV with a right digest. ``benchmarks/bench_kv_verify.py`` measures
it against the other candidates.

Test hook: with ``KVPATH_TEST_KV_VERIFY_FAULT=<prefix>`` in a D engine's environment, D
flips one byte of the first landed span of every checked push whose transfer id starts
with ``<prefix>``, just before it hashes them (only for tests: that request then fails).
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvpath.connector import messages as M
from kvpath.connector.tp_map import RankKV, heads_of, plan, rank_kv

logger = logging.getLogger(__name__)

KNOB = "kv_connector_extra_config.kv_verify"
ALG = "xxh3-128"
MAX_SAMPLE = 1 << 20
MAX_CHECK_BYTES = 160  # a check's wire form is about 60 bytes; anything longer is not one
FAULT_ENV = "KVPATH_TEST_KV_VERIFY_FAULT"
SMALL_ROWS = 256  # check_inside in plain Python up to this many spans


# -- the knob ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    every: int  # 0: off, 1: all, N: one push in N

    @property
    def on(self) -> bool:
        return self.every > 0


def parse_mode(value: Any) -> Mode:
    """``off``, ``all`` or ``sample:N`` (N in [1, 2^20]); ValueError naming the knob."""
    if not isinstance(value, str):
        raise ValueError(f"{KNOB} must be 'off', 'all' or 'sample:N', got {value!r}")
    v = value.strip().lower()
    if v == "off":
        return Mode(0)
    if v == "all":
        return Mode(1)
    if v.startswith("sample:"):
        n = v[len("sample:"):]
        if n.isdigit() and 1 <= int(n) <= MAX_SAMPLE:
            return Mode(int(n))
        raise ValueError(f"{KNOB}: sample:N needs an integer N in [1, {MAX_SAMPLE}] (one push in N is checked), "
                         f"got {value!r}")
    raise ValueError(f"{KNOB} must be 'off', 'all' or 'sample:N', got {value!r}")


def require_hash() -> None:
    """The hash's package, at start-up when the knob is on (ValueError naming the knob)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        raise ValueError(f"{KNOB} needs the xxhash package (pip install xxhash; kvpath pins it)") from None


def selected(mode: Mode, transfer_id: str) -> bool:
    """Whether ``transfer_id``'s push is checked: the same answer on P and D, from the id alone."""
    if mode.every <= 1:
        return mode.every == 1
    h = hashlib.blake2b(transfer_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "big") % mode.every == 0


# -- the check on the wire ------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """What P's notification carries: the digest and how P planned the WRITE."""

    alg: str
    digest: str  # hex
    nbytes: int  # bytes hashed (= the WRITE's bytes)
    p_tp: int  # P's TP size
    p_rank: int  # P's TP rank
    p_block_size: int  # tokens per P block
    tokens: int  # the tokens P planned (tp_map.plan's num_tokens); 0 at equal TP and block sizes


def encode_check(c: Check) -> bytes:
    return f"{c.alg},{c.digest},{c.nbytes},{c.p_tp},{c.p_rank},{c.p_block_size},{c.tokens}".encode()


def decode_check(raw: bytes) -> Check:
    """ValueError for anything that is not a check (a peer's bytes: bounded, strict)."""
    if len(raw) > MAX_CHECK_BYTES:
        raise ValueError(f"check of {len(raw)} bytes")
    try:
        alg, digest, *nums = raw.decode("ascii").split(",")
    except UnicodeDecodeError:
        raise ValueError("check is not ASCII") from None
    if len(nums) != 5 or not all(x.isdigit() and len(x) <= 15 for x in nums):
        raise ValueError(f"malformed check {raw[:80]!r}")
    if not digest or any(ch not in "0123456789abcdef" for ch in digest):
        raise ValueError(f"check with a digest that is not hex: {digest[:40]!r}")
    nbytes, p_tp, p_rank, p_bs, tokens = (int(x) for x in nums)
    if not 1 <= p_tp <= M.MAX_TP_SIZE or not 0 <= p_rank < p_tp or p_bs < 1:
        raise ValueError(f"check with P's TP rank {p_rank} of {p_tp}, block size {p_bs}")
    return Check(alg, digest, nbytes, p_tp, p_rank, p_bs, tokens)


# -- memory -------------------------------------------------------------------------------
class MemView:
    """Zero-copy views of a process's registered KV spans (DRAM)."""

    def __init__(self, spans: Sequence[tuple[int, int]]):
        merged: list[list[int]] = []
        for a, n in sorted((int(a), int(n)) for a, n in spans if n > 0):
            if merged and a <= merged[-1][0] + merged[-1][1]:  # adjacent: a merged row may cross them
                merged[-1][1] = max(merged[-1][1], a + n - merged[-1][0])
            else:
                merged.append([a, n])
        self.spans = [(a, n) for a, n in merged]
        self._starts = [a for a, _ in self.spans]
        self._views = [memoryview((ctypes.c_char * n).from_address(a)).cast("B") for a, n in self.spans]

    def view(self, addr: int, length: int) -> memoryview:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr + length > self.spans[i][0] + self.spans[i][1]:
            raise ValueError(f"span [{addr:#x}, +{length}) is outside the registered memory")
        off = addr - self.spans[i][0]
        return self._views[i][off:off + length]


def new_hash() -> Any:
    import xxhash

    return xxhash.xxh3_128()


def merged(rows: np.ndarray | list) -> list[tuple[int, int]]:
    """``(addr, len)`` of ``rows`` (``[addr, len, ...]``), each row that continues the
    previous one merged into it: the same bytes in the same order, fewer hash calls."""
    out: list[tuple[int, int]] = []
    a0 = n0 = 0
    for row in (rows.tolist() if isinstance(rows, np.ndarray) else rows):
        a, n = row[0], row[1]
        if not n:
            continue
        if n0 and a0 + n0 == a:
            n0 += n
        else:
            if n0:
                out.append((a0, n0))
            a0, n0 = a, n
    if n0:
        out.append((a0, n0))
    return out


def digest_rows(mem: MemView, rows: np.ndarray | list) -> tuple[str, int]:
    """(hex digest, bytes) of the spans ``rows`` (``[addr, len, ...]``), in row order."""
    h = new_hash()
    total = 0
    for addr, length in merged(rows):
        h.update(mem.view(addr, length))
        total += length
    return h.hexdigest(), total


# -- where a WRITE's bytes land on D ------------------------------------------------------
def tokens_written(p_block_size: int, p_blocks: int, d_block_size: int, d_blocks: int) -> int:
    """The tokens a WRITE between unequal TP or block sizes moves: those both sides'
    blocks hold (``d_blocks`` counts D's prefix hits too). write_loop's plan uses it."""
    return min(p_blocks * p_block_size, d_blocks * d_block_size)


MAX_P_BLOCKS_PER_D_BLOCK = 64  # vLLM's block sizes are 1-256 tokens, equal on P and D in practice


def same_sizes(chk: Check, d_layout: M.BlockLayout, d_compat: M.Compat) -> bool:
    """P's WRITE copied whole blocks (layout.build_descs), as P decides (lane_setup.same_sizes)."""
    return chk.p_tp == d_compat.tp_size and chk.p_block_size == d_layout.block_size


def d_rows(d_layout: M.BlockLayout, d_compat: M.Compat, chk: Check, block_ids: Sequence[int],
           skip_blocks: int) -> np.ndarray:
    """``[addr, len]`` rows of D's memory that P's WRITE (as ``chk`` says P planned it)
    wrote, in P's descriptor order (spans may be split or merged differently from P's
    descriptors: the bytes and their order are the same). ValueError when P's plan
    cannot be placed in these blocks."""
    if same_sizes(chk, d_layout, d_compat):
        # build_descs: per region, D's blocks in the registration's order, each whole (a
        # stretch of consecutive ids as one span where blocks are dense)
        runs: list[list[int]] = []
        for b in block_ids:
            if runs and b == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([b, 1])
        rows = []
        for r in d_layout.regions:
            if r.block_stride == r.block_len:
                rows += [(r.base + b * r.block_stride, k * r.block_len) for b, k in runs]
            else:
                rows += [(r.base + b * r.block_stride, r.block_len) for b in block_ids]
        return np.array(rows, dtype=np.uint64).reshape(-1, 2)
    dk = rank_kv(d_layout, d_compat)
    n_p = -(-chk.tokens // chk.p_block_size)
    if not 0 < chk.tokens <= (skip_blocks + len(block_ids)) * d_layout.block_size:
        raise ValueError(f"P planned {chk.tokens} tokens, D's {skip_blocks + len(block_ids)} blocks hold "
                         f"{(skip_blocks + len(block_ids)) * d_layout.block_size}")
    if n_p > MAX_P_BLOCKS_PER_D_BLOCK * (skip_blocks + len(block_ids)):
        # the plan's size follows P's claimed block size: a tiny one would make D plan and
        # hash millions of spans on its receiver thread
        raise ValueError(f"P's block size {chk.p_block_size} is under 1/{MAX_P_BLOCKS_PER_D_BLOCK} of D's "
                         f"{d_layout.block_size}")
    # P's side as the planner needs it: only D's rows are used (their order follows the
    # segments, cut at both sides' block boundaries, not P's addresses)
    blen = len(heads_of(chk.p_tp, chk.p_rank, dk.total_kv_heads)) * chk.p_block_size * dk.token_bytes
    pk = RankKV(chk.p_tp, chk.p_rank, dk.total_kv_heads, chk.p_block_size, dk.head_dim, dk.esz, n_p,
                [M.Region(1, blen, blen)] * len(dk.regions))
    _, rem, _ = plan(pk, dk, None, list(range(n_p)), [0] * skip_blocks + list(block_ids), chk.tokens,
                     skip_blocks * d_layout.block_size)
    return rem[:, :2]


def check_inside(layout: M.BlockLayout, rows: np.ndarray, block_ids: Sequence[int]) -> None:
    """ValueError unless every row lies inside blocks ``block_ids`` of one region (a
    row may run over consecutive blocks of a dense region, never over a gap)."""
    if rows.size == 0:
        return
    if len(rows) <= SMALL_ROWS:
        return _check_inside_small(layout, rows, block_ids)
    ids = np.asarray(list(block_ids), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= layout.num_blocks):
        raise ValueError(f"a registered block id is outside the {layout.num_blocks} blocks")
    owned = np.zeros(layout.num_blocks + 1, dtype=np.int64)
    owned[ids + 1] = 1
    csum = np.cumsum(owned)  # csum[b]: owned blocks below b
    a, n = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    regions = sorted(layout.regions, key=lambda r: r.base)
    bases = np.array([r.base for r in regions], dtype=np.int64)
    strides = np.array([r.block_stride for r in regions], dtype=np.int64)
    lens = np.array([r.block_len for r in regions], dtype=np.int64)

    def inside(i: np.ndarray, a: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Rows (a, n) inside region i's blocks that the request owns."""
        off, st = a - bases[i], strides[i]
        last = off + n - 1
        ok = (n > 0) & (off >= 0) & (last < layout.num_blocks * st)
        b0, b1 = np.where(ok, off // st, 0), np.where(ok, last // st, 0)
        gappy = st != lens[i]  # gaps between blocks: one block, inside its bytes
        ok &= ~gappy | ((b0 == b1) & (last % st < lens[i]))
        return ok & ((csum[b1 + 1] - csum[b0]) == (b1 - b0 + 1))

    # each row against the region it starts in when regions do not interleave; the rows
    # that fail are tried against every region (interleaved regions, or truly outside)
    cand = np.clip(np.searchsorted(bases, a, side="right") - 1, 0, len(bases) - 1)
    ok = inside(cand, a, n)
    for i in np.flatnonzero(~ok):
        idx = np.arange(len(bases))
        ok[i] = bool(inside(idx, np.full(len(idx), a[i]), np.full(len(idx), n[i])).any())
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"a span [{int(a[i]):#x}, +{int(n[i])}) lies outside the request's registered blocks")


def _check_inside_small(layout: M.BlockLayout, rows: np.ndarray, block_ids: Sequence[int]) -> None:
    """check_inside in plain Python: a push of few spans (numpy's per-call cost would
    dominate: this is the common case, whole blocks at equal sizes)."""
    owned = set(block_ids)
    if owned and (min(owned) < 0 or max(owned) >= layout.num_blocks):
        raise ValueError(f"a registered block id is outside the {layout.num_blocks} blocks")
    regions = sorted(layout.regions, key=lambda r: r.base)
    bases = [r.base for r in regions]

    def inside(r: M.Region, a: int, n: int) -> bool:
        off = a - r.base
        last = off + n - 1
        if n <= 0 or off < 0 or last >= layout.num_blocks * r.block_stride:
            return False
        b0, b1 = off // r.block_stride, last // r.block_stride
        if r.block_stride != r.block_len and (b0 != b1 or last % r.block_stride >= r.block_len):
            return False
        return all(b in owned for b in range(b0, b1 + 1))

    for a, n in rows[:, :2].tolist():
        i = bisect.bisect_right(bases, a) - 1
        if not ((i >= 0 and inside(regions[i], a, n)) or any(inside(r, a, n) for r in regions)):
            raise ValueError(f"a span [{a:#x}, +{n}) lies outside the request's registered blocks")


# -- P and D ----------------------------------------------------------------------------
class Verifier:
    """One engine thread's kv_verify: P hashes what it sends, D what landed."""

    def __init__(self, mode: Mode, layout: M.BlockLayout, spans: Sequence[tuple[int, int]], side: str):
        if layout.mem_type != "DRAM":
            raise ValueError(f"{KNOB}: the KV cache is in {layout.mem_type}, and kv_verify hashes host memory "
                             "only (DRAM): set it to off")
        require_hash()
        self.mode = mode
        self.mem = MemView(spans)
        self.fault = os.environ.get(FAULT_ENV, "") if side == "d" else ""
        if self.fault:
            logger.warning("kv_verify: TEST HOOK %s=%r is set: a byte of every checked push whose transfer id "
                           "starts with it is flipped on arrival, so those requests fail", FAULT_ENV, self.fault)
        self._missing_logged = False

    @classmethod
    def make(cls, knob: str, layout: M.BlockLayout, spans: Sequence[tuple[int, int]], side: str
             ) -> "Verifier | None":
        mode = parse_mode(knob)
        return cls(mode, layout, spans, side) if mode.on else None

    def selected(self, transfer_id: str) -> bool:
        return selected(self.mode, transfer_id)

    # P -----------------------------------------------------------------------------
    def p_notif(self, transfer_id: str, layout: M.BlockLayout, compat: M.Compat, hello: M.Hello,
                p_blocks: Sequence[int], reg: M.Register, loc: np.ndarray) -> bytes:
        """The completion notification of P's WRITE with descriptors ``loc``: with the
        check when this push is chosen."""
        if not self.selected(transfer_id):
            return M.make_notif(transfer_id)
        same = hello.compat.tp_size == compat.tp_size and hello.layout.block_size == layout.block_size
        tokens = 0 if same else tokens_written(layout.block_size, len(p_blocks), hello.layout.block_size,
                                               reg.skip_blocks + len(reg.block_ids))
        digest, nbytes = digest_rows(self.mem, loc)
        chk = Check(ALG, digest, nbytes, compat.tp_size, compat.tp_rank, layout.block_size, tokens)
        return M.make_notif(transfer_id, encode_check(chk))

    # D -----------------------------------------------------------------------------
    def check_landed(self, transfer_id: str, w: Any, reg: M.Register | None, raw_check: bytes | None,
                     layout: M.BlockLayout, compat: M.Compat, stats: Any) -> str:
        """"" when flow ``w``'s push of ``transfer_id`` (registered as ``reg``) checks out,
        or came without a check; else why it failed (for the log and the request's
        failure). Called on the receiver thread before the notification ends the flow, so
        the blocks are still the request's."""
        if raw_check is None:
            stats.inc("kv_verify_skipped")
            if not self._missing_logged:
                self._missing_logged = True
                logger.warning("kv_verify: the push of transfer %s came without a check: P does not have kv_verify "
                               "set to this value (counted in kv_verify_skipped, logged once)", transfer_id)
            return ""
        try:
            bad = self._check(w, reg, transfer_id, raw_check, layout, compat)
        except Exception as e:  # a bug here must not lose the notification: the flow fails instead
            logger.exception("kv_verify: checking transfer %s raised", transfer_id)
            return f"kv_verify: transfer {transfer_id}: checking it raised {type(e).__name__}: {e}"
        if not bad:
            stats.inc("kv_verify_ok")
        return bad

    def _check(self, w: Any, reg: M.Register | None, transfer_id: str, raw_check: bytes, layout: M.BlockLayout,
               compat: M.Compat) -> str:
        try:
            if reg is None:
                raise ValueError("D kept no registration for this flow")
            chk = decode_check(raw_check)
            if chk.alg != ALG:
                raise ValueError(f"P hashed with {chk.alg!r}, D knows {ALG!r}")
            p_tp_expected = reg.p_tp_size or compat.tp_size
            if chk.p_tp != p_tp_expected or (w.peer_rank >= 0 and chk.p_rank != w.peer_rank):
                raise ValueError(f"P says TP rank {chk.p_rank} of {chk.p_tp}, D registered with rank "
                                 f"{w.peer_rank} of {p_tp_expected}")
            rows = d_rows(layout, compat, chk, reg.block_ids, reg.skip_blocks)
            check_inside(layout, rows, reg.block_ids)
            if self.fault and transfer_id.startswith(self.fault):
                self._flip_one_byte(rows, transfer_id)
            digest, nbytes = digest_rows(self.mem, rows)
        except ValueError as e:
            return f"kv_verify: transfer {transfer_id}: the check cannot be placed in D's blocks: {e}"
        if nbytes != chk.nbytes:
            return (f"kv_verify: transfer {transfer_id}: P hashed {chk.nbytes} bytes, D's blocks for it hold "
                    f"{nbytes}")
        if digest != chk.digest:
            return (f"kv_verify: transfer {transfer_id}: the KV that landed differs from what P sent "
                    f"({nbytes} bytes; {ALG} {digest} on D, {chk.digest} from P rank {chk.p_rank})")
        return ""

    def _flip_one_byte(self, rows: np.ndarray, transfer_id: str) -> None:
        for addr, length in rows.tolist():
            if length:
                v = self.mem.view(addr, 1)
                v[0] ^= 0xFF
                logger.warning("kv_verify: TEST HOOK flipped the byte at %#x of transfer %s", addr, transfer_id)
                return
