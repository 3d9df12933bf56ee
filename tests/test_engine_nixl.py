"""Real NIXL pushes between two processes over UCX TCP (no vLLM)."""

import random
import time
import uuid

import pytest
import zmq

from connector.config import KVPathConfig
from connector.layout import layout_from_buffers
from connector.peer_process import BufferSpec, PeerProcess, make_buffers
from connector.sender import PushSender

SPEC = BufferSpec(regions=3, num_blocks=96, block_len=2048, block_size=16)
_port = [5900]


def cfg(**kw) -> KVPathConfig:
    _port[0] += 3
    base = dict(side_channel_port=_port[0], ucx_net_devices="lo", lease_timeout_s=3.0, registration_timeout_s=4.0)
    base.update(kw)
    return KVPathConfig(**base)


class PSide:
    def __init__(self, c: KVPathConfig):
        self.bufs = make_buffers(SPEC, "random", seed=7)
        spans = [(b.ctypes.data, b.nbytes) for b in self.bufs]
        self.sender = PushSender(c, layout_from_buffers(spans, SPEC.num_blocks, SPEC.block_size), spans).start()

    def expect(self, blocks):
        return [b.reshape(SPEC.num_blocks, SPEC.block_len)[blocks].tobytes() for b in self.bufs]

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
    lanes = next(iter(p.sender.lanes().values()))
    assert len(lanes) == p.sender.cfg.lanes
    ports = [l.src_ports[0] for l in lanes]
    assert all(ports) and len(set(ports)) == len(ports), "each lane has its own source port"


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
        from connector.params import default_lane

        kv = [r for r in records if getattr(r, "transfer_id", "").startswith("lane-")]
        assert [r.lane for r in kv] == [2, 0, 1, default_lane("lane-3", 3)]
        lanes = next(iter(p.sender.lanes().values()))
        assert [r.src_port for r in kv[:3]] == [lanes[2].src_ports[0], lanes[0].src_ports[0], lanes[1].src_ports[0]]
        assert all(r.descriptors == SPEC.regions and r.bytes == SPEC.regions * SPEC.block_len for r in kv)
    p.sender.close()


def test_malformed_and_duplicate_registrations_are_dropped_and_counted():
    c = cfg(lanes=1)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.connect(f"tcp://{p.sender.address}")
        s.send(b"\x00garbage")
        s.send_multipart([b"a", b"b"])
        time.sleep(0.3)
        assert p.sender.stats.snapshot()["messages_malformed"] == 2
        d.call("register", "d1", "dup", p.sender.address, [5], 0)
        d.call("register", "d1", "dup", p.sender.address, [5], 0)  # D-side dedupe
        p.sender.submit_finished("p1", "dup", [9])
        p.sender.submit_finished("p1", "dup", [9])  # P-side dedupe
        _, done, failed = d.call("wait", ["d1"], 10)
        assert done == ["d1"] and not failed
        time.sleep(0.2)
        assert p.sender.stats.snapshot()["pushes_ok"] == 1
        s.close(0)
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


def test_d_watchdog_fails_request_when_p_is_dead_or_silent():
    c = cfg(lanes=1, registration_timeout_s=1.0)
    with PeerProcess(c, SPEC) as d:
        # nobody listens on this port: the registration goes nowhere
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


def test_killed_d_during_push_ends_cleanly_on_p():
    c = cfg(lanes=1, lease_timeout_s=1.0, transfer_timeout_s=3.0)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        d.call("register", "d1", "k1", p.sender.address, [1], 0)
        p.sender.submit_finished("p1", "k1", [2])
        d.call("wait", ["d1"], 10)
        d.kill()
        # after D died: a new push to it fails or expires, and P frees the blocks
        p.sender.submit_finished("p2", "k2", [3])
        assert "p2" in p.wait_released(["p2"], timeout=6)
    p.sender.close()
