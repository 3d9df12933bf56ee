"""uplink_pushes and push_order with real NIXL between two processes, no vLLM: while
another engine on the host holds the host's one uplink slot, two matched pushes wait;
when it frees the slot, srpt posts the smaller one first, and the second only after the
first ended; both land whole. A Cancel of a waiting push ends it unposted."""

import os
import uuid

import pytest

from kvpath.connector.push_order import UplinkSlots
from kvpath.testbed.peer_process import PeerProcess
from kvpath.trace import read_transfers
from tests.connector.nixl_sides import SPEC, PSide, cfg

pytestmark = pytest.mark.usefixtures("nixl_keys")


@pytest.fixture
def capped(tmp_path):
    c = cfg(lanes=1, uplink_pushes=1, push_order="srpt", push_queue_max_wait_s=10.0, fabric_host="l0h0",
            uplink_slots_dir=str(tmp_path), trace_path=str(tmp_path / "log-{pid}.jsonl"))
    blocker = UplinkSlots("l0h0", 1, str(tmp_path))  # "another engine on the host"
    assert blocker.take() == 0
    p = PSide(c)
    with PeerProcess(c, SPEC) as d:
        yield p, d, blocker, tmp_path
    p.sender.close()


def _records(tmp_path):
    return {r.transfer_id: r for r in read_transfers(tmp_path / f"log-{os.getpid()}.jsonl")}


def test_srpt_posts_the_smaller_push_first_once_the_slot_is_free(capped):
    p, d, blocker, tmp_path = capped
    big, small = uuid.uuid4().hex, uuid.uuid4().hex
    d.call("register", "d-big", big, p.sender.address, list(range(40, 56)), 0)
    d.call("register", "d-small", small, p.sender.address, [60], 0)
    p.sender.submit_finished("p-big", big, list(range(0, 16)))
    p.sender.submit_finished("p-small", small, [20])
    _, done, _ = d.call("wait", ["d-big", "d-small"], 0.5)
    assert done == []  # both wait for the host's slot
    assert p.sender.stats.snapshot()["pushes_queued"] == 2
    blocker.give(0)
    _, done, failed = d.call("wait", ["d-big", "d-small"], 10)
    assert sorted(done) == ["d-big", "d-small"] and not failed
    assert d.call("read", list(range(40, 56)))[1] == p.expect(list(range(0, 16)))
    assert d.call("read", [60])[1] == p.expect([20])
    p.sender.close()
    rec = _records(tmp_path)
    assert rec[small].submit_at < rec[big].submit_at  # the smaller went first ...
    assert rec[big].submit_at >= rec[small].completed_at  # ... and the other only once it ended (one slot)
    assert p.sender.stats.snapshot()["pushes_queue_overdue"] == 0


def test_a_cancelled_waiting_push_ends_unposted_and_frees_its_blocks(capped):
    p, d, blocker, _ = capped
    tid = uuid.uuid4().hex
    d.call("register", "d-c", tid, p.sender.address, [70], 0)
    p.sender.submit_finished("p-c", tid, [30])
    _, done, _ = d.call("wait", ["d-c"], 0.3)
    assert done == []
    d.call("cancel", "d-c")  # D's request ended while its push waits for the slot
    _, done, _ = d.call("wait", ["d-c"], 10)
    assert done == ["d-c"]  # D released its blocks: P answered that nothing was posted
    assert "p-c" in p.wait_released(["p-c"])
    s = p.sender.stats.snapshot()
    assert s["pushes_cancelled"] == 1 and s["pushes_ok"] == 0
    assert d.call("read", [70])[1] != p.expect([30])  # no byte of it landed
