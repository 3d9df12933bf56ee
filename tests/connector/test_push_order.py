"""The uplink's slots and the push queue (connector/push_order.py), without NIXL: a
host-wide cap that two processes share and a killed one gives back, srpt and fifo order,
the wait's bounds, a Cancel, and every slot given back when pushes end."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from kvpath.connector.push_order import QUEUE_MARGIN_S, PushQueue, UplinkSlots


def _m(key: str, post_by: float = float("inf")):
    return SimpleNamespace(prefill=SimpleNamespace(key=key), registration=SimpleNamespace(post_by=post_by))


def test_slots_are_shared_by_every_holder_on_the_host(tmp_path):
    a, b = UplinkSlots("l0h0", 2, str(tmp_path)), UplinkSlots("l0h0", 2, str(tmp_path))
    other_host = UplinkSlots("l0h1", 2, str(tmp_path))
    assert a.take() == 0 and b.take() == 1  # two holders, one set of slots
    assert a.take() is None and b.take() is None
    assert other_host.take() == 0  # another host's uplink has its own
    a.give(0)
    assert b.take() == 0


def test_a_killed_holder_gives_its_slot_back(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from kvpath.connector.push_order import UplinkSlots
        s = UplinkSlots("l0h0", 1, {str(tmp_path)!r})
        assert s.take() == 0
        print("held", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        mine = UplinkSlots("l0h0", 1, str(tmp_path))
        assert mine.take() is None
        p.kill()
        p.wait(10)
        assert mine.take() == 0  # the kernel dropped the dead process's lock
    finally:
        p.kill()


@pytest.mark.parametrize("order, first", [("srpt", "small"), ("fifo", "big")])
def test_waiting_pushes_start_in_order_as_slots_free(tmp_path, order, first):
    blocker = UplinkSlots("h", 1, str(tmp_path))
    assert blocker.take() == 0  # another engine's push holds the host's one slot
    q = PushQueue(order, UplinkSlots("h", 1, str(tmp_path)), max_wait_s=60)
    big, small = _m("big"), _m("small")
    assert not q.admit(big, 10_000, 0.0) and not q.admit(small, 100, 0.0)
    assert q.ready(1.0) == [] and len(q) == 2
    blocker.give(0)
    got = q.ready(1.0)
    assert [m.prefill.key for m, _ in got] == [first] and got[0][1] is False  # one slot: one starts
    assert q.admit(got[0][0], 0, 1.0)  # cleared: it posts
    assert q.ready(2.0) == []
    q.done(first)  # it ended: the slot goes to the other
    assert [m.prefill.key for m, _ in q.ready(2.0)] == [{"big": "small", "small": "big"}[first]]


def test_a_push_waits_no_longer_than_its_bound_or_its_deadline(tmp_path):
    blocker = UplinkSlots("h", 1, str(tmp_path))
    blocker.take()
    q = PushQueue("srpt", UplinkSlots("h", 1, str(tmp_path)), max_wait_s=0.5)
    late, tight = _m("late"), _m("tight", post_by=10.0)
    assert not q.admit(late, 1, 0.0) and not q.admit(tight, 1, 9.0 - QUEUE_MARGIN_S)
    assert q.ready(0.4) == []
    assert [(m.prefill.key, over) for m, over in q.ready(0.5)] == [("late", True)]
    assert q.ready(10.0 - QUEUE_MARGIN_S) == [(tight, True)]  # before D's post_by, though its bound is not reached


def test_a_cancelled_push_leaves_the_queue_and_nothing_is_held_after(tmp_path):
    blocker = UplinkSlots("h", 1, str(tmp_path))
    blocker.take()
    slots = UplinkSlots("h", 1, str(tmp_path))
    q = PushQueue("fifo", slots, max_wait_s=60)
    a = _m("a")
    assert not q.admit(a, 1, 0.0)
    assert q.take("a") is a and not q.holds("a") and q.ready(1.0) == []
    blocker.give(0)
    b = _m("b")
    assert q.admit(b, 1, 0.0)  # nothing waits and a slot is free: it posts at once
    q.done("b")
    assert slots.held() == 0
    assert q.drop_all() == []


def test_without_a_cap_nothing_waits():
    q = PushQueue("srpt", None, max_wait_s=0.0)
    assert all(q.admit(_m(str(i)), i, 0.0) for i in range(5)) and len(q) == 0 and not q.active


def test_a_slot_folder_others_can_reach_is_refused(tmp_path):
    import os

    folder = tmp_path / f"kvpath-uplink-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)  # another user could hold our slots, or swap the files
    with pytest.raises(PermissionError):
        UplinkSlots("h", 1, str(tmp_path))
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")  # not followed
    with pytest.raises(PermissionError):
        UplinkSlots("h", 1, str(tmp_path))


def test_a_push_holding_its_slot_is_admitted_again_without_a_second_slot(tmp_path):
    slots = UplinkSlots("h", 2, str(tmp_path))
    q = PushQueue("fifo", slots, max_wait_s=60)
    a = _m("a")
    assert q.admit(a, 1, 0.0) and slots.held() == 1
    assert q.admit(a, 1, 0.0) and slots.held() == 1  # (start() again after a lane reopened)
    q.done("a")
    assert slots.held() == 0
