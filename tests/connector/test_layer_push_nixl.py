"""Layer-wise push (push_granularity=layer) with real NIXL between two processes, no vLLM:
P's three regions stand for three layers. Layers land while the "forward" runs; D completes
only at the commit (after the request finished), never on a partial push; a registration
that comes mid-forward gets one catch-up WRITE of exactly the layers done; an abort
mid-push fails D's request after the posted WRITEs end and frees P's blocks; the engine
thread's calls make no NIXL call."""

import threading
import time
import uuid

import pytest

from kvpath.connector import nixl_io
from kvpath.testbed.peer_process import PeerProcess
from tests.connector.nixl_sides import SPEC, PSide, cfg

pytestmark = pytest.mark.usefixtures("nixl_keys")

LAYERS = SPEC.regions  # one region per "layer"


@pytest.fixture
def pair():
    c = cfg(lanes=1, push_granularity="layer", push_layer_group=1)
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        yield p, d
    p.sender.close()


def _landed(d, dst, p, src) -> list[bool]:
    """Per layer: D's blocks hold P's bytes."""
    got, want = d.call("read", dst)[1], p.expect(src)
    return [g == w for g, w in zip(got, want)]


def _wait_landed(d, dst, p, src, n, timeout=5.0) -> list[bool]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _landed(d, dst, p, src)
        if sum(got) >= n:
            return got
        time.sleep(0.02)
    return _landed(d, dst, p, src)


def _not_done(d, rid, wait=0.4) -> bool:
    _, done, _ = d.call("wait", [rid], wait)
    return rid not in done


def test_layers_land_during_the_forward_and_only_the_commit_completes_d(pair):
    p, d = pair
    src, dst, tid = [5, 6, 9], [20, 21, 40], uuid.uuid4().hex
    d.call("register", "d1", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    p.sender.begin("p1", tid, src, None, None, "", forward=1, layers=LAYERS)
    p.sender.layers_done(1, 1)
    assert _wait_landed(d, dst, p, src, 1) == [True, False, False]  # layer 0 only, before the forward ends
    assert _not_done(d, "d1"), "a partial push completed D's request"
    p.sender.forward_done(1, LAYERS)
    assert _wait_landed(d, dst, p, src, 3) == [True, True, True]
    assert _not_done(d, "d1"), "D completed before P's request finished (no commit yet)"
    p.sender.submit_finished("p1", tid, src)
    _, done, failed = d.call("wait", ["d1"], 10)
    assert done == ["d1"] and not failed
    assert "p1" in p.wait_released(["p1"])
    s = p.sender.stats.snapshot()
    assert s["pushes_ok"] == 1 and s["layer_writes"] == 2  # layer 0, then layers 1-2


def test_a_registration_mid_forward_gets_one_catch_up_write_of_exactly_the_layers_done(pair):
    p, d = pair
    src, dst, tid = [1, 2], [50, 51], uuid.uuid4().hex
    p.sender.begin("p2", tid, src, None, None, "", forward=7, layers=LAYERS)
    p.sender.layers_done(7, 2)
    time.sleep(0.1)
    d.call("register", "d2", tid, p.sender.address, dst, 0)
    assert _wait_landed(d, dst, p, src, 2) == [True, True, False]  # the catch-up: layers 0 and 1, not 2
    time.sleep(0.2)
    assert _landed(d, dst, p, src) == [True, True, False]
    assert p.sender.stats.snapshot()["layer_writes"] == 1
    p.sender.forward_done(7, LAYERS)
    p.sender.submit_finished("p2", tid, src)
    _, done, failed = d.call("wait", ["d2"], 10)
    assert done == ["d2"] and not failed and _landed(d, dst, p, src) == [True] * 3
    assert p.sender.stats.snapshot()["layer_writes"] == 2


def test_a_registration_after_the_request_finished_gets_the_whole_push(pair):
    p, d = pair
    src, dst, tid = [30, 31, 32], [60, 61, 62], uuid.uuid4().hex
    p.sender.begin("p3", tid, src, None, None, "", forward=2, layers=LAYERS)
    p.sender.forward_done(2, LAYERS)
    p.sender.submit_finished("p3", tid, src)
    time.sleep(0.1)
    d.call("register", "d3", tid, p.sender.address, dst, 0)
    _, done, failed = d.call("wait", ["d3"], 10)
    assert done == ["d3"] and not failed and _landed(d, dst, p, src) == [True] * 3
    assert "p3" in p.wait_released(["p3"])
    assert p.sender.stats.snapshot().get("layer_writes", 0) == 0  # one WRITE, as request granularity


def test_an_abort_mid_push_fails_d_after_the_posted_writes_and_frees_p_blocks_only_then(pair):
    p, d = pair
    src, dst, tid = [10, 11], [70, 71], uuid.uuid4().hex
    d.call("register", "d4", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    p.sender.begin("p4", tid, src, None, None, "", forward=3, layers=LAYERS)
    p.sender.layers_done(3, 1)
    _wait_landed(d, dst, p, src, 1)
    assert "p4" not in p.sender.take_finished()  # its request still runs: its blocks are held
    p.sender.abort(tid, "p4")
    _, done, failed = d.call("wait", ["d4"], 10)
    assert done == ["d4"] and failed == ["d4"]
    assert "p4" in p.wait_released(["p4"])
    s = p.sender.stats.snapshot()
    assert s["pushes_failed"] == 1 and s.get("pushes_ok", 0) == 0


def test_a_push_that_ends_early_holds_the_blocks_of_a_running_request_until_it_ends(pair):
    p, d = pair
    src, dst, tid = [12], [72], uuid.uuid4().hex
    d.call("register", "d5", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    d.call("cancel", "d5")  # D gives up before P's forward: nothing posted
    time.sleep(0.2)
    p.sender.begin("p5", tid, src, None, None, "", forward=4, layers=LAYERS)
    p.sender.forward_done(4, LAYERS)
    time.sleep(0.3)
    assert "p5" not in p.sender.take_finished()  # vLLM must not free a running request's blocks
    p.sender.submit_finished("p5", tid, src)
    assert "p5" in p.wait_released(["p5"], timeout=3)


def test_the_engine_thread_makes_no_nixl_call(pair, monkeypatch):
    p, d = pair
    calls: list[str] = []
    agent_cls = nixl_io.load_nixl().nixl_agent
    for name in ("initialize_xfer", "transfer", "check_xfer_state", "get_xfer_descs", "send_notif",
                 "release_xfer_handle"):
        orig = getattr(agent_cls, name)

        def spy(self, *a, _orig=orig, **kw):
            calls.append(threading.current_thread().name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(agent_cls, name, spy)
    src, dst, tid = [40, 41], [80, 81], uuid.uuid4().hex
    d.call("register", "d6", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    engine = threading.current_thread().name
    p.sender.begin("p6", tid, src, None, None, "", forward=5, layers=LAYERS)
    for n in range(1, LAYERS + 1):
        p.sender.layers_done(5, n)
        time.sleep(0.05)
    p.sender.forward_done(5, LAYERS)
    p.sender.submit_finished("p6", tid, src)
    _, done, failed = d.call("wait", ["d6"], 10)
    assert done == ["d6"] and not failed
    assert calls and engine not in calls and set(calls) == {"kvpath-push-sender"}


def test_an_abort_naming_another_request_with_the_same_transfer_id_leaves_the_push_alone(pair):
    p, d = pair
    src, dst, tid = [13, 14], [74, 75], uuid.uuid4().hex
    d.call("register", "d7", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    p.sender.begin("p7", tid, src, None, None, "", forward=6, layers=LAYERS)
    p.sender.begin("p7b", tid, [15], None, None, "", forward=6, layers=LAYERS)  # reuses the id: not tracked
    p.sender.layers_done(6, 1)
    _wait_landed(d, dst, p, src, 1)
    p.sender.abort(tid, "p7b")  # the second request ends: its blocks free at once, p7's push goes on
    assert "p7b" in p.wait_released(["p7b"], timeout=3)
    p.sender.forward_done(6, LAYERS)
    p.sender.submit_finished("p7", tid, src)
    _, done, failed = d.call("wait", ["d7"], 10)
    assert done == ["d7"] and not failed and _landed(d, dst, p, src) == [True] * 3
    assert "p7" in p.wait_released(["p7"])


def test_d_cancelling_a_flow_that_posted_nothing_ends_it_not_posted(pair):
    p, d = pair
    src, dst, tid = [16], [76], uuid.uuid4().hex
    d.call("register", "d8", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    p.sender.begin("p8", tid, src, None, None, "", forward=8, layers=LAYERS)  # matched, no layer yet
    time.sleep(0.1)
    d.call("cancel", "d8")
    _, done, failed = d.call("wait", ["d8"], 5)
    assert done == ["d8"] and not failed  # cancelled, nothing posted: released without a fence
    assert p.sender.stats.snapshot()["pushes_cancelled"] == 1
    p.sender.forward_done(8, LAYERS)
    time.sleep(0.2)
    assert "p8" not in p.sender.take_finished()  # its request still runs
    p.sender.submit_finished("p8", tid, src)
    assert "p8" in p.wait_released(["p8"], timeout=3)


def test_chunk_wise_a_finished_chunk_lands_while_the_next_computes_and_only_the_commit_completes(pair):
    p, d = pair
    bs = SPEC.block_size
    src, dst, tid = [20, 21, 22, 23], [84, 85, 86, 87], uuid.uuid4().hex
    d.call("register", "d9", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    # chunk 1 computes tokens 0-39: blocks 0 and 1 are final once it ends
    p.sender.begin("p9", tid, src[:3], None, None, "", forward=20, layers=LAYERS, final_before=0,
                   final_after=2 * bs)
    time.sleep(0.2)
    assert d.call("read", dst[:2])[1] != p.expect(src[:2])  # not before the chunk's forward ended
    p.sender.forward_done(20, LAYERS)
    assert _wait_landed(d, dst[:2], p, src[:2], LAYERS) == [True] * LAYERS  # chunk 1's blocks, every layer
    assert d.call("read", dst[2:])[1] != p.expect(src[2:])
    # the last chunk: tokens from 32 on, layer by layer
    p.sender.begin("p9", tid, src, None, None, "", forward=21, layers=LAYERS, final_before=2 * bs)
    p.sender.layers_done(21, 1)
    time.sleep(0.2)
    assert _not_done(d, "d9")
    p.sender.forward_done(21, LAYERS)
    p.sender.submit_finished("p9", tid, src)
    _, done, failed = d.call("wait", ["d9"], 10)
    assert done == ["d9"] and not failed
    assert d.call("read", dst)[1] == p.expect(src)
    assert "p9" in p.wait_released(["p9"])


def test_a_preempted_chunk_wise_push_is_pushed_anew_from_the_new_blocks(pair):
    p, d = pair
    bs = SPEC.block_size
    old, new, dst, tid = [30, 31, 32], [40, 41, 42], [88, 89, 90], uuid.uuid4().hex
    d.call("register", "d10", tid, p.sender.address, dst, 0)
    time.sleep(0.2)
    p.sender.begin("p10", tid, old[:2], None, None, "", forward=30, layers=LAYERS, final_before=0,
                   final_after=2 * bs)
    p.sender.forward_done(30, LAYERS)
    # the first chunk landed (from blocks now freed)
    assert _wait_landed(d, dst[:2], p, old[:2], LAYERS) == [True] * LAYERS
    p.sender.restart(tid, "p10")  # vLLM preempted it; it is computed again into other blocks
    p.sender.begin("p10", tid, new, None, None, "", forward=31, layers=LAYERS, final_before=0)
    p.sender.forward_done(31, LAYERS)
    p.sender.submit_finished("p10", tid, new)
    _, done, failed = d.call("wait", ["d10"], 10)
    assert done == ["d10"] and not failed
    assert d.call("read", dst)[1] == p.expect(new)  # every block written again from the new ones
    assert p.sender.stats.snapshot()["layer_restarts"] == 1


class _Reserver:
    """The reservation service's client, recorded: grants lane 0 and a lease at once."""

    def __init__(self):
        self.calls: list[tuple] = []

    def reserve(self, src_host, dst_host, nbytes, lanes=None, transfer_id="", scope=None, *, done):
        self.calls.append(("reserve", nbytes))
        done(transfer_id, 0, "lease-7")

    def update(self, lease_id, nbytes, expected_end_s=None):
        self.calls.append(("update", lease_id, nbytes, expected_end_s))

    def release(self, lease_id):
        self.calls.append(("release", lease_id))

    def register_lanes(self, *a, **kw):
        pass

    def unregister_lanes(self, *a, **kw):
        pass

    def close(self):
        pass


def test_a_lane_reserved_at_the_first_chunk_learns_its_bytes_and_end_at_the_last_forward():
    """reserve_at=push: the chunk-wise push reserves its lane when its first chunk begins
    (the bytes of the blocks D's registration names: the whole prompt); when its last
    forward begins, the lease is told the whole push's bytes and when it expects to end
    (its pace so far); released at the commit."""
    c = cfg(lanes=1, push_granularity="chunk", push_layer_group=1, reserve_at="push",
            reservation_url="http://127.0.0.1:9", fabric_host="l0h0")
    p = PSide(c)
    p.sender.notifier = rec = _Reserver()
    bs = SPEC.block_size
    src, dst, tid = [50, 51, 52, 53], [60, 61, 62, 63], uuid.uuid4().hex
    try:
        with PeerProcess(c, SPEC) as d:
            d.call("register", "d11", tid, p.sender.address, dst, 0)
            time.sleep(0.2)
            p.sender.begin("p11", tid, src[:2], None, None, "", forward=40, layers=LAYERS, final_before=0,
                           final_after=2 * bs)
            p.sender.forward_done(40, LAYERS)
            assert _wait_landed(d, dst[:2], p, src[:2], LAYERS) == [True] * LAYERS
            time.sleep(0.1)
            assert [k[0] for k in rec.calls] == ["reserve"]  # not updated before the last forward
            p.sender.begin("p11", tid, src, None, None, "", forward=41, layers=LAYERS, final_before=2 * bs)
            p.sender.forward_done(41, LAYERS)
            p.sender.submit_finished("p11", tid, src)
            _, done, failed = d.call("wait", ["d11"], 10)
            assert done == ["d11"] and not failed
            assert "p11" in p.wait_released(["p11"])
    finally:
        p.sender.close()
    whole = len(src) * LAYERS * SPEC.block_len
    kinds = [k[0] for k in rec.calls]
    assert kinds == ["reserve", "update", "release"], rec.calls
    assert rec.calls[0][1] == whole
    _, lease, nbytes, expected = rec.calls[1]
    assert (lease, nbytes) == ("lease-7", whole)
    assert expected is not None and expected >= 0  # the first chunk's WRITE set its pace
    assert p.sender.stats.snapshot()["leases_updated"] == 1


def test_a_one_forward_push_whose_reservation_was_exact_sends_no_update():
    """The lease of a layer-wise push of one forward already has its bytes (its blocks all
    existed when it reserved) and nothing has landed to pace it: no update is sent."""
    c = cfg(lanes=1, push_granularity="layer", push_layer_group=1, reserve_at="push",
            reservation_url="http://127.0.0.1:9", fabric_host="l0h0")
    p = PSide(c)
    p.sender.notifier = rec = _Reserver()
    src, dst, tid = [54, 55], [64, 65], uuid.uuid4().hex
    try:
        with PeerProcess(c, SPEC) as d:
            d.call("register", "d12", tid, p.sender.address, dst, 0)
            time.sleep(0.2)
            p.sender.begin("p12", tid, src, None, None, "", forward=50, layers=LAYERS)
            p.sender.forward_done(50, LAYERS)
            p.sender.submit_finished("p12", tid, src)
            _, done, failed = d.call("wait", ["d12"], 10)
            assert done == ["d12"] and not failed
            assert "p12" in p.wait_released(["p12"])
    finally:
        p.sender.close()
    assert [k[0] for k in rec.calls] == ["reserve", "release"], rec.calls
    assert rec.calls[0][1] == len(src) * LAYERS * SPEC.block_len
