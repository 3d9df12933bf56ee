"""The writer's state machine: both orders, duplicates, leases, cancels, aborts."""

from connector.messages import BlockLayout, Region, Register
from connector.push_state import FinishedPrefill, WriterState
from connector.recv_state import ReceiverState


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def reg(tid, blocks=(1, 2)):
    lay = BlockLayout([Region(4096, 64, 64)], 16, 16)
    return Register(tid, "d-" + tid, "eng", "agent", b"meta", lay, list(blocks))


def fp(tid, rid=None):
    return FinishedPrefill(rid or "p-" + tid, tid, [3, 4])


def test_registration_first_then_prefill_matches_once():
    s = WriterState(lease_s=5)
    assert s.add_registration(reg("t1"), b"id") == ("waiting", None)
    status, m = s.add_prefill(fp("t1"))
    assert status == "matched" and m.prefill.transfer_id == "t1" and m.registration.reg.transfer_id == "t1"
    assert s.complete("t1").prefill.request_id == "p-t1"
    assert s.idle()


def test_prefill_first_then_registration_matches_once():
    s = WriterState(lease_s=5)
    assert s.add_prefill(fp("t1")) == ("waiting", None)
    status, m = s.add_registration(reg("t1"), b"id")
    assert status == "matched" and m.registration.reply_to == b"id"


def test_duplicates_are_reported_never_rematched():
    s = WriterState(lease_s=5)
    s.add_registration(reg("t1"), b"id")
    assert s.add_registration(reg("t1"), b"id")[0] == "duplicate"
    s.add_prefill(fp("t1"))
    assert s.add_prefill(fp("t1"))[0] == "duplicate"
    assert s.add_registration(reg("t1"), b"id")[0] == "duplicate"
    s.complete("t1")
    # after completion, a late duplicate is still recognised
    assert s.add_registration(reg("t1"), b"id")[0] == "duplicate"
    assert s.add_prefill(fp("t1"))[0] == "dead"  # the caller frees it (and dedupes by request id)
    assert s.status_of("t1") == "ok"


def test_lease_expiry_frees_unmatched_prefill_and_registration():
    c = Clock()
    s = WriterState(lease_s=2, clock=c)
    s.add_prefill(fp("a"))
    s.add_registration(reg("b"), b"id")
    c.t = 1.9
    ex = s.expire()
    assert not ex.prefills and not ex.registrations
    c.t = 2.0
    ex = s.expire()
    assert [p.transfer_id for p in ex.prefills] == ["a"]
    assert [r.reg.transfer_id for r in ex.registrations] == ["b"]
    assert s.idle() and s.status_of("a") == "expired"
    # a registration arriving after the prefill's lease expired is a duplicate of a dead transfer
    assert s.add_registration(reg("a"), b"id")[0] == "duplicate"


def test_cancel_before_match_frees_prefill_and_after_match_is_in_flight():
    s = WriterState(lease_s=5)
    s.add_prefill(fp("a"))
    status, freed, _ = s.cancel("a")
    assert status == "cancelled" and freed.request_id == "p-a"
    s.add_registration(reg("b"), b"id")
    s.add_prefill(fp("b"))
    assert s.cancel("b")[0] == "in_flight"
    # the prefill of a cancelled transfer finishing later is dead on arrival
    assert s.add_prefill(fp("a"))[0] == "dead"


def test_aborted_prefill_rejects_registration_in_either_order():
    s = WriterState(lease_s=5)
    s.add_registration(reg("a"), b"id")
    assert s.abort_prefill("a").reg.transfer_id == "a"
    assert s.abort_prefill("b") is None
    assert s.add_registration(reg("b"), b"id")[0] == "aborted"


def test_receiver_watchdog_and_cancel():
    c = Clock()
    r = ReceiverState(timeout_s=3, clock=c)
    assert r.add("d1", "t1", "h:1")
    assert not r.add("d1", "t1", "h:1")
    r.add("d2", "t2", "h:1")
    r.add("d3", "t3", "h:1")
    r.on_done("t1")
    r.cancel_request("d3")
    c.t = 3.0
    expired = r.expire()
    assert {w.transfer_id for w in expired} == {"t2", "t3"}
    finished, failed = r.take()
    assert finished == {"d1", "d2", "d3"}
    assert failed == {"d2"}  # d3 was given up by D itself: released, not failed
    assert r.take() == (set(), set())


def test_receiver_failure_ack_and_early_notification():
    r = ReceiverState(timeout_s=3)
    r.add("d1", "t1", "h:1")
    r.on_failed("t1")
    assert r.take() == ({"d1"}, {"d1"})
    assert r.on_done("t9") is None  # notification before the registration was recorded
    r.add("d9", "t9", "h:1")
    assert r.take() == ({"d9"}, set())
