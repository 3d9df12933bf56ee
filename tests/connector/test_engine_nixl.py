"""Real NIXL pushes between two processes over UCX TCP (no vLLM), P and D at equal
TP size and block size: fragmented pushes byte exact, lanes (choice, ports, the fabric
spec's paths, the trace log), duplicates, leases, timeouts, aborts, a killed D, a
mismatched peer, a restarted P, a fault in an engine loop. TP and block-size fan-out:
test_engine_nixl_tp.py."""

import random
import time
import uuid

import pytest

from kvpath.connector.config import ConfigError
from kvpath.connector.layout import layout_from_buffers
from kvpath.testbed.peer_process import PeerProcess, make_buffers
from tests.connector.nixl_sides import SPEC, PSide, cfg

pytestmark = pytest.mark.usefixtures("nixl_keys")


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


def test_one_p_named_two_ways_is_one_link_and_every_request_arrives():
    """D's links share one routing id and P hands it to the newest connection: a second link
    to the same P under another spelling took it from the first, and from then on every
    request to that P under either spelling was lost (two of four here, before the fix)."""
    c = cfg(lanes=1)
    p = PSide(c)
    port = p.sender.address.rsplit(":", 1)[1]
    spellings = [f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", f"127.0.0.1:{port}"]
    with PeerProcess(c, SPEC) as d:
        for i, peer in enumerate(spellings):
            d.call("register", f"d{i}", f"n{i}", peer, [10 + i], 0)
            p.sender.submit_finished(f"p{i}", f"n{i}", [40 + i])
            _, done, failed = d.call("wait", [f"d{i}"], 10)
            assert done == [f"d{i}"] and not failed, f"request {i} to {peer}"
            assert d.call("read", [10 + i])[1] == p.expect([40 + i])
        stats = p.sender.stats.snapshot()
        assert stats["handshakes"] == 1 and stats["registrations"] == 4
        assert stats["control_disconnects"] == 0
    p.sender.close()


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
