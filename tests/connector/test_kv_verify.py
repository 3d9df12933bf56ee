"""kv_verify (connector/kv_verify.py): the knob, sample selection, the digest over a push's
spans, the spans D recomputes for what P planned (equal and unequal TP and block sizes),
the bound on them, the notification's wire form; then real NIXL pushes between two
processes that are checked, with and without a byte flipped on arrival."""

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvpath.connector import kv_verify as V
from kvpath.connector import messages as M
from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.sender import PushSender
from kvpath.connector.tp_map import peer_ranks


# -- the knob ---------------------------------------------------------------------------
@pytest.mark.parametrize("value,every", [("off", 0), ("all", 1), ("sample:1", 1), ("sample:8", 8), (" ALL ", 1)])
def test_the_knob_parses(value, every):
    assert V.parse_mode(value).every == every


@pytest.mark.parametrize("value", ["on", "sample", "sample:0", "sample:-2", "sample:x", "sample:1.5",
                                   f"sample:{V.MAX_SAMPLE + 1}", "", 1, True, None])
def test_a_bad_value_is_refused_at_start_up_naming_kv_verify(value):
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.kv_verify"):
        KVPathConfig.from_extra_config({"kv_verify": value, "control_plaintext": True})


def test_the_knob_defaults_to_off_and_takes_its_values():
    assert KVPathConfig().kv_verify == "off"
    assert KVPathConfig.from_extra_config({"kv_verify": "sample:4", "control_plaintext": True}).kv_verify == "sample:4"


def test_kv_verify_needs_its_hash_package_and_a_kv_cache_in_host_memory(monkeypatch):
    lay = M.BlockLayout(regions=[M.Region(1 << 20, 256, 256)], num_blocks=4, block_size=16, mem_type="VRAM")
    with pytest.raises(ValueError, match=r"kv_verify: the KV cache is in VRAM"):
        V.Verifier.make("all", lay, [(1 << 20, 1024)], "d")
    assert V.Verifier.make("off", lay, [(1 << 20, 1024)], "d") is None
    monkeypatch.setitem(sys.modules, "xxhash", None)  # not installed
    with pytest.raises(ConfigError, match=r"kv_verify needs the xxhash package"):
        KVPathConfig.from_extra_config({"kv_verify": "all", "control_plaintext": True})
    KVPathConfig.from_extra_config({"kv_verify": "off", "control_plaintext": True})  # off needs nothing


# -- which pushes ------------------------------------------------------------------------
def test_sample_n_checks_about_one_push_in_n_and_the_same_ones_every_time():
    ids = [f"cmpl-{i:06d}-{i * 7919 % 1000}" for i in range(20000)]
    for n in (2, 4, 16):
        mode = V.parse_mode(f"sample:{n}")
        picked = [t for t in ids if V.selected(mode, t)]
        assert abs(len(picked) - len(ids) / n) < 5 * (len(ids) / n) ** 0.5, (n, len(picked))
        assert picked == [t for t in ids if V.selected(mode, t)]
    assert all(V.selected(V.parse_mode("all"), t) for t in ids[:100])
    assert not any(V.selected(V.parse_mode("off"), t) for t in ids[:100])


def test_p_and_d_processes_pick_the_same_pushes_whatever_their_hash_seed():
    """The choice comes from the transfer id alone (not Python's salted hash()), so two
    engines agree without a message."""
    ids = [f"t{i}" for i in range(400)]
    here = [V.selected(V.parse_mode("sample:3"), t) for t in ids]
    code = ("import sys, json; from kvpath.connector import kv_verify as V; "
            "print(json.dumps([V.selected(V.parse_mode('sample:3'), f't{i}') for i in range(400)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert [bool(x) for x in __import__("json").loads(out)] == here
    assert 90 < sum(here) < 180


# -- the digest ---------------------------------------------------------------------------
def _mem(*arrays):
    return V.MemView([(a.ctypes.data, a.nbytes) for a in arrays])


def test_the_digest_covers_the_spans_bytes_in_row_order_without_copies():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)
    mem = _mem(a, b)
    rows = np.array([[a.ctypes.data + 100, 300, 0], [b.ctypes.data, 50, 0], [a.ctypes.data, 10, 0]], dtype=np.uint64)
    digest, n = V.digest_rows(mem, rows)
    want = xxhash.xxh3_128(a[100:400].tobytes() + b[:50].tobytes() + a[:10].tobytes()).hexdigest()
    assert n == 360 and digest == want
    # a span split in two or two adjacent spans merged: the same bytes, the same digest
    split = np.array([[a.ctypes.data + 100, 120, 0], [a.ctypes.data + 220, 180, 0], [b.ctypes.data, 50, 0],
                      [a.ctypes.data, 10, 0]], dtype=np.uint64)
    assert V.digest_rows(mem, split) == (digest, n)
    assert V.digest_rows(mem, rows[[1, 0, 2]])[0] != digest  # the order is part of it
    a[399] ^= 1
    assert V.digest_rows(mem, rows)[0] != digest  # one bit of one byte
    a[399] ^= 1
    a[400] ^= 1  # a byte outside the spans
    assert V.digest_rows(mem, rows)[0] == digest
    with pytest.raises(ValueError, match="outside the registered memory"):
        V.digest_rows(mem, np.array([[a.ctypes.data + 4000, 200]], dtype=np.uint64))
    # two registered spans that touch: rows merged across them hash as the bytes they are
    halves = V.MemView([(a.ctypes.data, 2048), (a.ctypes.data + 2048, 2048)])
    across = np.array([[a.ctypes.data + 2000, 48], [a.ctypes.data + 2048, 52]], dtype=np.uint64)
    assert V.digest_rows(halves, across)[0] == xxhash.xxh3_128(a[2000:2100].tobytes()).hexdigest()


# -- D's spans for what P planned ------------------------------------------------------------
def _side(regions, num_blocks, block_len, block_size, tp, rank, heads, seed):
    bufs = [np.random.default_rng(seed + i).integers(0, 256, num_blocks * block_len, dtype=np.uint8)
            for i in range(regions)]
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    lay = layout_from_buffers(spans, num_blocks, block_size)
    compat = M.Compat(model="m", block_size=block_size, kv_layout=lay.shape(), tp_size=tp, tp_rank=rank,
                      kv_heads=heads)
    return bufs, spans, lay, compat


def _writer(lay, compat, spans):
    """P's writer without its thread: its write loop plans the WRITE's descriptors."""
    from tests.connector.engine_doubles import bare_sender

    return bare_sender(layout=lay, compat=compat)


ROW = 32  # bytes of one token's K (or V) row of one head


@pytest.mark.parametrize("p_tp,d_tp,p_bs,d_bs,heads", [
    (1, 1, 16, 16, 4),  # equal sizes: build_descs, whole blocks
    (2, 1, 16, 16, 4),  # P rank writes half the heads of each D block
    (1, 2, 16, 16, 4),  # P's block split over two D ranks
    (2, 2, 32, 64, 4),  # unequal block sizes
    (1, 1, 64, 32, 4),
    (4, 2, 32, 64, 4),
    (2, 1, 32, 32, 1),  # one KV head replicated on P: rank 1 writes nothing
])
@pytest.mark.parametrize("skip", [0, 1])
def test_d_recomputes_exactly_the_bytes_p_wrote_and_a_flipped_byte_is_caught(p_tp, d_tp, p_bs, d_bs, heads, skip):
    """For each (P rank, D rank) flow: P's descriptors as its write loop makes them; the
    WRITE emulated by copying each source span to its destination; D's recomputed spans
    (from its own layout, its registration and the check) hash to P's digest, lie inside
    its registered blocks, and cover exactly the bytes that were written."""
    n_tokens, nb = 150, 24
    p_heads, d_heads = max(1, heads // p_tp), max(1, heads // d_tp)
    rng = np.random.default_rng(p_tp * 100 + d_tp * 10 + skip)
    for d_rank in range(d_tp):
        d_bufs, d_spans, d_lay, d_compat = _side(2, nb, d_heads * d_bs * 2 * ROW, d_bs, d_tp, d_rank, heads, 50)
        n_d = -(-n_tokens // d_bs)
        d_blocks = [int(x) for x in rng.permutation(nb)[:n_d]]  # scattered
        reg = M.Register(transfer_id="t", request_id="d", agent_name="a", block_ids=d_blocks[skip:], skip_blocks=skip,
                         p_tp_size=p_tp)
        hello = M.Hello("d", "a", b"m", d_lay, d_compat, "i", 1.0)
        for p_rank in peer_ranks(p_tp, d_tp, d_rank, heads):
            p_bufs, p_spans, p_lay, p_compat = _side(2, nb, p_heads * p_bs * 2 * ROW, p_bs, p_tp, p_rank, heads,
                                                     10 + p_rank)
            p = _writer(p_lay, p_compat, p_spans)
            p_blocks = [int(x) for x in rng.permutation(nb)[:-(-n_tokens // p_bs)]]
            loc, rem, nbytes = p.writes.plans.whole(hello, p_blocks, reg)
            before = [b.copy() for b in d_bufs]
            for (s, ln, _), (t, _, _) in zip(loc.tolist(), rem.tolist()):  # the WRITE
                V.MemView(d_spans).view(t, ln)[:] = V.MemView(p_spans).view(s, ln)
            ver = V.Verifier(V.parse_mode("all"), p_lay, p_spans, "p")
            raw = M.split_notif(ver.p_notif("t", p_lay, p_compat, hello, p_blocks, reg, loc))[1]
            chk = V.decode_check(raw)
            assert (chk.nbytes, chk.p_tp, chk.p_rank, chk.p_block_size) == (nbytes, p_tp, p_rank, p_bs)
            rows = V.d_rows(d_lay, d_compat, chk, reg.block_ids, skip)
            V.check_inside(d_lay, rows, reg.block_ids)
            d_mem = V.MemView(d_spans)
            assert V.digest_rows(d_mem, rows) == (chk.digest, nbytes)
            # the spans are exactly the bytes the WRITE changed (random bytes: a changed
            # byte differs with probability 255/256, so compare the covered set instead)
            covered = [np.zeros(b.nbytes, dtype=bool) for b in d_bufs]
            for addr, ln in rows.tolist():
                for b, c in zip(d_bufs, covered):
                    if b.ctypes.data <= addr < b.ctypes.data + b.nbytes:
                        c[addr - b.ctypes.data: addr - b.ctypes.data + ln] = True
            written = [np.zeros(b.nbytes, dtype=bool) for b in d_bufs]
            for t, ln, _ in rem.tolist():
                for b, c in zip(d_bufs, written):
                    if b.ctypes.data <= t < b.ctypes.data + b.nbytes:
                        c[t - b.ctypes.data: t - b.ctypes.data + ln] = True
            assert all((c == w).all() for c, w in zip(covered, written))
            assert all((b[~w] == o[~w]).all() for b, o, w in zip(d_bufs, before, written))
            if nbytes:
                addr = int(rows[len(rows) // 2, 0])
                d_mem.view(addr, 1)[0] ^= 0x10
                assert V.digest_rows(d_mem, rows)[0] != chk.digest
                d_mem.view(addr, 1)[0] ^= 0x10


# -- the bound ---------------------------------------------------------------------------
@pytest.fixture(params=["python", "numpy"])
def bound_path(request, monkeypatch):
    """check_inside's two paths: plain Python for few spans, numpy for many."""
    monkeypatch.setattr(V, "SMALL_ROWS", 256 if request.param == "python" else 0)


def test_spans_outside_the_requests_registered_blocks_are_refused(bound_path):
    base, bl, nb = 1 << 20, 256, 16
    dense = M.BlockLayout(regions=[M.Region(base, bl, bl), M.Region(base + nb * bl, bl, bl)], num_blocks=nb,
                          block_size=16)
    mine = [3, 4, 5, 9]
    ok = np.array([[base + 3 * bl, 3 * bl],  # blocks 3-5 in one span
                   [base + 9 * bl + 10, 20],  # inside block 9
                   [base + nb * bl + 4 * bl, bl]], dtype=np.uint64)  # block 4 of region 1
    V.check_inside(dense, ok, mine)
    for row in ([base + 5 * bl, 2 * bl],  # runs from block 5 into block 6 (not the request's)
                [base + 2 * bl + bl - 1, 2],  # starts in block 2
                [base - 8, 8],  # before the region
                [base + 2 * nb * bl, 8],  # past the last region
                [base + 7 * bl, 1]):  # another request's block
        with pytest.raises(ValueError, match="outside the request's registered blocks"):
            V.check_inside(dense, np.array([row], dtype=np.uint64), mine)
    # interleaved blocks (stride > length): a span may not reach into the gap
    gappy = M.BlockLayout(regions=[M.Region(base, 2 * bl, bl)], num_blocks=nb, block_size=16)
    V.check_inside(gappy, np.array([[base + 3 * 2 * bl, bl]], dtype=np.uint64), [3])
    for row in ([base + 3 * 2 * bl, bl + 1], [base + 3 * 2 * bl + bl, 4], [base + 3 * 2 * bl, 2 * bl + bl]):
        with pytest.raises(ValueError):
            V.check_inside(gappy, np.array([row], dtype=np.uint64), [3, 4])
    with pytest.raises(ValueError, match="registered block id"):
        V.check_inside(dense, ok, [nb])


def test_a_check_that_places_bytes_beyond_ds_blocks_is_refused():
    _, _, d_lay, d_compat = _side(2, 24, 4 * 32 * 2 * ROW, 32, 1, 0, 4, 1)
    chk = V.Check(V.ALG, "00", 0, 1, 0, 64, 5 * 32)  # 160 tokens into D's 4 blocks of 32
    with pytest.raises(ValueError, match="160 tokens"):
        V.d_rows(d_lay, d_compat, chk, [1, 2, 3, 4], 0)


# -- the wire ---------------------------------------------------------------------------
def test_the_notification_carries_the_check_and_stays_as_it_was_without_one():
    assert M.make_notif("abc") == b"kvpath:done:abc"
    assert M.split_notif(M.make_notif("abc")) == ("abc", None) and M.parse_notif(M.make_notif("abc")) == "abc"
    chk = V.Check(V.ALG, "ab" * 16, 123456, 2, 1, 32, 100)
    raw = M.make_notif("x:y/z", V.encode_check(chk))
    assert len(raw) < 100
    tid, got = M.split_notif(raw)
    assert tid == "x:y/z" and V.decode_check(got) == chk and M.parse_notif(raw) == "x:y/z"
    assert M.split_notif(b"kvpath:done+nocolon") is None and M.split_notif(b"other") is None
    with pytest.raises(ValueError):
        M.make_notif("t", b"a:b")
    for bad in (b"", b"xxh3-128,zz,1,1,0,16,0", b"xxh3-128,ab,1,1,1,16,0", b"xxh3-128,ab,1,1,0,0,0",
                b"xxh3-128,ab,1,1,0,16", b"xxh3-128,ab,-1,1,0,16,0", b"a" * 200, "\u00e9".encode()):
        with pytest.raises(ValueError):
            V.decode_check(bad)


# -- real NIXL, two processes -------------------------------------------------------------
SPEC_KW = dict(regions=3, num_blocks=64, block_len=2048, block_size=16)


@pytest.fixture
def keyed(cluster_keys):
    return cluster_keys


def _cfg(keys, port, **kw):
    return KVPathConfig(side_channel_port=port, ucx_net_devices="lo", lanes=1, lease_timeout_s=3.0,
                        registration_timeout_s=4.0, max_wait_s=6.0, fence_grace_s=0.3, kv_verify="all",
                        **keys, **kw)


def test_checked_pushes_land_and_a_flipped_byte_fails_that_request_by_name(keyed, monkeypatch):
    """kv_verify=all on both sides: pushes whose bytes arrive intact are released as
    received (kv_verify_ok); with the test hook flipping one byte of a landed block of
    one transfer on D, that request (only) is failed, its error names kv_verify and the
    transfer, exactly one mismatch is counted, and its blocks are released."""
    from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers

    spec = BufferSpec(**SPEC_KW)
    c = _cfg(keyed, 6710)
    bufs = make_buffers(spec, "random", seed=3)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    p = PushSender(c, layout_from_buffers(spans, spec.num_blocks, spec.block_size), spans).start()
    monkeypatch.setenv(V.FAULT_ENV, "corrupt-")  # read by D's process (spawned now)
    try:
        with PeerProcess(c, spec) as d:
            cases = [("ok-1", [1, 2, 3], [10, 11, 12]), ("corrupt-1", [4, 9], [20, 30]), ("ok-2", [5], [40])]
            for i, (tid, src, dst) in enumerate(cases):
                d.call("register", f"d{i}", tid, p.address, dst, 0)
                p.submit_finished(f"p{i}", tid, src)
                _, done, failed = d.call("wait", [f"d{i}"], 20)
                assert done == [f"d{i}"], tid
                assert failed == ([f"d{i}"] if tid.startswith("corrupt-") else []), tid
            stats = d.call("stats")[1]
            assert (stats["kv_verify_ok"], stats["kv_verify_mismatch"], stats["recv_ok"], stats["recv_failed"]) == \
                (2, 1, 2, 1)
            # the intact pushes' bytes are P's (the corrupted one differs in one byte)
            got = d.call("read", [10, 11, 12, 40])[1]
            assert got == [b.reshape(spec.num_blocks, -1)[[1, 2, 3, 5]].tobytes() for b in bufs]
            bad = d.call("read", [20, 30])[1]
            want = [b.reshape(spec.num_blocks, -1)[[4, 9]].tobytes() for b in bufs]
            assert sum(x != y for bb, ww in zip(bad, want) for x, y in zip(bb, ww)) == 1
        assert p.stats.snapshot()["pushes_ok"] == 3  # P cannot tell: D's check failed the request
    finally:
        p.close()


def test_a_d_rank_fed_by_two_p_ranks_checks_each_flow_against_its_own_heads(keyed, monkeypatch, capfd):
    """P at TP 2 into D at TP 1 (each P rank writes half the heads of every D block), and
    unequal block sizes: D recomputes each flow's slice from the check. Then one flow
    corrupted: the request fails, naming kv_verify and the transfer id."""
    from kvpath.testbed.peer_process import BufferSpec, PeerProcess, make_buffers

    heads, p_bs, d_bs = 4, 16, 32
    p_spec = BufferSpec(regions=2, num_blocks=40, block_len=2 * p_bs * 2 * ROW, block_size=p_bs)  # 2 heads
    d_spec = BufferSpec(regions=2, num_blocks=40, block_len=4 * d_bs * 2 * ROW, block_size=d_bs)  # 4 heads
    c = _cfg(keyed, 6730)
    ps = []
    monkeypatch.setenv(V.FAULT_ENV, "split-bad")
    try:
        for r in range(2):
            bufs = make_buffers(p_spec, "random", seed=70 + r)
            spans = [(b.ctypes.data, b.nbytes) for b in bufs]
            lay = layout_from_buffers(spans, p_spec.num_blocks, p_bs)
            compat = M.Compat(model="m", dtype="float32", block_size=p_bs, kv_layout=lay.shape(), tp_size=2, tp_rank=r,
                              kv_heads=heads)
            ps.append((bufs, PushSender(c, lay, spans, rank=r, compat=compat).start()))
        d_shape = f"2x[{d_spec.block_len},{d_spec.block_len}]"
        d_compat = M.Compat(model="m", dtype="float32", block_size=d_bs, kv_layout=d_shape, tp_size=1, tp_rank=0,
                            kv_heads=heads)
        with PeerProcess(c, d_spec, compat=d_compat) as d:
            ranks = peer_ranks(2, 1, 0, heads)
            for i, tid in enumerate(["split-ok", "split-bad"]):
                d.call("register", f"d{i}", tid, [ps[r][1].address for r in ranks], [3 + 4 * i, 5 + 4 * i, 4 + 4 * i],
                       0, None, "", 2, ranks)
                for r in ranks:
                    ps[r][1].submit_finished(f"p{i}-r{r}", tid, [7 + i, 20 + i, 12 + i, 30 + i, 33 + i])  # 80 tokens
                _, done, failed = d.call("wait", [f"d{i}"], 20)
                assert done == [f"d{i}"] and failed == ([f"d{i}"] if tid == "split-bad" else []), tid
            stats = d.call("stats")[1]
            # the good request: 2 flows checked; the bad one: each flow of it is corrupted on arrival
            assert stats["kv_verify_ok"] == 2 and stats["kv_verify_mismatch"] >= 1
            assert stats["kv_verify_ok"] + stats["kv_verify_mismatch"] <= 4
    finally:
        for _, s in ps:
            s.close()
    err = capfd.readouterr().err
    assert "kv_verify: transfer split-bad" in err and "request d1 fails" in err


def test_the_bound_takes_rows_that_touch_across_two_regions(bound_path):
    """K and V halves of one tensor are two regions back to back: the last block of one
    and the first of the other touch in memory (rows there are checked one by one)."""
    base, bl, nb = 1 << 20, 256, 8
    lay = M.BlockLayout(regions=[M.Region(base, bl, bl), M.Region(base + nb * bl, bl, bl)], num_blocks=nb,
                        block_size=16)
    rows = np.array([[base + 7 * bl, bl], [base + nb * bl, bl]], dtype=np.uint64)  # K block 7, V block 0
    V.check_inside(lay, rows, [0, 7])
    with pytest.raises(ValueError):
        V.check_inside(lay, np.array([[base + 7 * bl, 2 * bl]], dtype=np.uint64), [0, 7])  # one span over both


def test_a_check_claiming_a_tiny_p_block_size_is_refused_before_planning():
    """After review: the plan's size follows P's claimed block size; one far below D's
    would make D build millions of spans on its receiver thread."""
    import pytest as _pytest

    from kvpath.connector import messages as M
    from kvpath.connector.kv_verify import Check, d_rows

    lay = M.BlockLayout([M.Region(4096, 1024, 1024)], 16, 128)  # 2 heads x 128 tokens x 4 B
    compat = M.Compat(tp_size=1, kv_heads=2)
    chk = Check("xxh3-128", "0" * 32, 1, 2, 0, 1, 128 * 4)
    with _pytest.raises(ValueError, match="block size 1"):
        d_rows(lay, compat, chk, [0, 1, 2, 3], 0)
