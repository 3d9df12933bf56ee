"""P's writer state machine (``SenderState``): both orders, duplicates, leases, cancels,
aborts, transfer keys, one prefill fanned out to several flows (D's TP size above P's).
D's side (``ReceiverState``): test_push_state_receiver.py."""

from kvpath.connector.messages import Register
from kvpath.connector.push_state import FinishedPrefill, SenderState, flow_key
from tests.connector.state_doubles import Clock


def reg(tid, blocks=(1, 2)):
    return Register(tid, "d-" + tid, "agent", list(blocks))


def add_reg(s, tid, ident=b"id", post_by=5.0):
    return s.add_registration(reg(tid), ident, post_by)


def fp(tid, rid=None):
    return FinishedPrefill(rid or "p-" + tid, tid, [3, 4])


def test_registration_first_then_prefill_matches_once():
    s = SenderState(lease_s=5)
    assert add_reg(s, "t1") == ("waiting", None)
    status, (m,) = s.add_prefill(fp("t1"))
    assert status == "matched" and m.prefill.transfer_id == "t1" and m.registration.reg.transfer_id == "t1"
    assert s.complete("t1").prefill.request_id == "p-t1"
    assert s.idle()


def test_prefill_first_then_registration_matches_once():
    s = SenderState(lease_s=5)
    assert s.add_prefill(fp("t1")) == ("waiting", [])
    status, m = add_reg(s, "t1")
    assert status == "matched" and m.registration.reply_to == b"id"


def test_duplicates_are_reported_never_rematched():
    s = SenderState(lease_s=5)
    add_reg(s, "t1")
    assert add_reg(s, "t1")[0] == "duplicate"
    s.add_prefill(fp("t1"))
    assert s.add_prefill(fp("t1"))[0] == "duplicate"
    assert add_reg(s, "t1")[0] == "duplicate"
    s.complete("t1")
    # after completion, a late duplicate is still recognised
    assert add_reg(s, "t1")[0] == "duplicate"
    assert s.add_prefill(fp("t1"))[0] == "dead"  # the caller frees it (and dedupes by request id)
    assert s.status_of("t1") == "ok"


def test_lease_expiry_frees_unmatched_prefill_and_post_by_expires_registration():
    c = Clock()
    s = SenderState(lease_s=2, clock=c)
    s.add_prefill(fp("a"))
    add_reg(s, "b", post_by=2.0)
    c.t = 1.9
    ex = s.expire()
    assert not ex.prefills and not ex.registrations
    c.t = 2.0
    ex = s.expire()
    assert [p.transfer_id for p in ex.prefills] == ["a"]
    assert [r.reg.transfer_id for r in ex.registrations] == ["b"]
    assert s.idle() and s.status_of("a") == "expired"
    # a registration arriving after the prefill's lease expired is a duplicate of a dead transfer
    assert add_reg(s, "a")[0] == "duplicate"


def test_cancel_before_match_frees_prefill_and_after_match_is_in_flight():
    s = SenderState(lease_s=5)
    s.add_prefill(fp("a"))
    # nobody registered "a": a Cancel (bound to its sender's registrations) leaves it be
    assert s.cancel("a") == ("unregistered", None, None) and s.holder("a") == "p-a"
    add_reg(s, "c")
    status, freed, dropped = s.cancel("c")
    assert status == "cancelled" and freed is None and dropped.reg.transfer_id == "c"
    add_reg(s, "b")
    s.add_prefill(fp("b"))
    assert s.cancel("b")[0] == "in_flight"
    # the prefill of a cancelled transfer finishing later is dead on arrival
    assert s.add_prefill(fp("c"))[0] == "dead"


def test_aborted_prefill_rejects_registration_in_either_order():
    s = SenderState(lease_s=5)
    add_reg(s, "a")
    assert [pr.reg.transfer_id for pr in s.abort_prefill("a")] == ["a"]
    assert s.abort_prefill("b") == []
    assert add_reg(s, "b")[0] == "aborted"


def test_cancel_keeps_the_record_of_an_ended_transfer_and_records_unseen_ones():
    c = Clock()
    s = SenderState(lease_s=5, clock=c)
    add_reg(s, "a")
    s.add_prefill(fp("a"))
    s.complete("a", "failed", posted=True)
    assert s.cancel("a") == ("done", None, None) and s.final("a") == ("failed", True)
    assert s.abort_prefill("a") == [] and s.final("a") == ("failed", True)  # nor an abort
    add_reg(s, "b")
    s.add_prefill(fp("b"))
    s.complete("b", "failed", posted=False)  # failed before the post
    assert s.cancel("b")[0] == "done" and s.final("b") == ("failed", False)
    assert s.cancel("never-seen")[0] == "cancelled" and s.final("never-seen") == ("cancelled", False)
    assert add_reg(s, "never-seen")[0] == "duplicate"  # a late Register is refused
    s.add_prefill(fp("x"))
    s.expire()
    assert s.final("x") is None
    c.t = 5.0
    s.expire()
    assert s.final("x") == ("expired", False)


def test_duplicate_prefill_is_told_apart_from_its_holder():
    s = SenderState(lease_s=5)
    s.add_prefill(fp("t", rid="p1"))
    assert s.add_prefill(fp("t", rid="p2"))[0] == "duplicate"
    assert s.holder("t") == "p1"  # the writer frees p2's blocks, never p1's
    add_reg(s, "t")
    assert s.holder("t") == "p1" and [r.reg.transfer_id for r in s.held_registrations()] == ["t"]

def test_a_registration_without_the_transfer_key_is_refused_in_either_order():
    key = "s" * 24
    s = SenderState(lease_s=5)
    s.add_prefill(FinishedPrefill("p-a", "a", [1], transfer_key=key))
    assert s.add_registration(Register("a", "d", "agent", [1]), b"mallory", 5.0) == ("key_mismatch", None)
    assert s.holder("a") == "p-a"  # the prefill keeps waiting
    status, m = s.add_registration(Register("a", "d", "agent", [1], transfer_key=key), b"owner", 5.0)
    assert status == "matched" and m.registration.reply_to == b"owner"
    # registration first
    s.add_registration(Register("b", "d", "agent", [1], transfer_key="wrong" * 5), b"mallory", 5.0)
    status, (m,) = s.add_prefill(FinishedPrefill("p-b", "b", [2], transfer_key=key))
    assert status == "key_mismatch" and m.registration.reply_to == b"mallory"
    assert s.holder("b") == "p-b" and s.registered_by("b") is None
    assert s.add_registration(Register("b", "d", "agent", [1], transfer_key=key), b"owner", 5.0)[0] == "matched"
    # no key on P's request: any registration (clients that send none)
    s.add_prefill(FinishedPrefill("p-c", "c", [3]))
    assert s.add_registration(Register("c", "d", "agent", [1]), b"d", 5.0)[0] == "matched"


# -- one prefill, several flows (D's TP size above P's) -------------------------
FAN = (flow_key("t", 0, 2), flow_key("t", 1, 2))


def fan_reg(s, d_rank, ident=None, post_by=5.0, tid="t"):
    keys = (flow_key(tid, 0, 2), flow_key(tid, 1, 2))
    return s.add_registration(Register(tid, f"d{d_rank}", f"agent{d_rank}", [1, 2]), ident or b"d%d" % d_rank,
                              post_by, keys[d_rank], keys)


def test_flow_keys_are_the_transfer_id_for_one_flow_and_distinct_for_several():
    assert flow_key("t", 0, 1) == "t" and flow_key("t", 3, 1) == "t"
    assert len({flow_key("t", d, 2) for d in range(2)} | {"t"}) == 3


def test_both_d_ranks_first_then_the_prefill_starts_both_flows_and_frees_the_blocks_at_the_last():
    s = SenderState(lease_s=5)
    assert fan_reg(s, 0) == ("waiting", None) and fan_reg(s, 1) == ("waiting", None)
    status, ms = s.add_prefill(fp("t"))
    assert status == "matched" and sorted(m.prefill.key for m in ms) == sorted(FAN)
    assert {m.registration.reply_to for m in ms} == {b"d0", b"d1"}
    assert ms[0].prefill.block_ids == ms[1].prefill.block_ids == [3, 4]
    assert s.holder("t") == "p-t" and s.add_prefill(fp("t", rid="other"))[0] == "duplicate"
    s.complete(ms[0].prefill.key)
    assert s.flow_ended(ms[0].prefill) is False  # the other flow still reads the blocks
    s.complete(ms[1].prefill.key)
    assert s.flow_ended(ms[1].prefill) is True
    assert s.idle() and s.add_prefill(fp("t", rid="late"))[0] == "dead"  # the id is spent
    assert fan_reg(s, 0)[0] == "duplicate"


def test_the_prefill_first_is_split_at_the_first_registration():
    s = SenderState(lease_s=5)
    assert s.add_prefill(fp("t")) == ("waiting", [])
    status, m0 = fan_reg(s, 0)
    assert status == "matched" and m0.prefill.key == FAN[0]
    status, m1 = fan_reg(s, 1)
    assert status == "matched" and m1.prefill.key == FAN[1] and m1.prefill.share is m0.prefill.share
    assert fan_reg(s, 1)[0] == "duplicate"


def test_a_d_rank_that_never_registers_expires_alone_and_the_blocks_wait_for_the_other_flow():
    c = Clock()
    s = SenderState(lease_s=2, clock=c)
    s.add_prefill(fp("t"))
    _, m0 = fan_reg(s, 0)
    c.t = 3
    ex = s.expire()
    assert [p.key for p in ex.prefills] == [FAN[1]] and s.status_of(FAN[1]) == "expired"
    assert s.flow_ended(ex.prefills[0]) is False  # flow 0 is being written
    s.complete(FAN[0])
    assert s.flow_ended(m0.prefill) is True


def test_a_flow_cancelled_before_the_prefill_counts_as_ended_and_all_cancelled_makes_it_dead():
    s = SenderState(lease_s=5)
    fan_reg(s, 0)
    fan_reg(s, 1)
    status, fp0, pr = s.cancel(FAN[0])
    assert status == "cancelled" and fp0 is None and pr.key == FAN[0]
    status, ms = s.add_prefill(fp("t"))
    assert status == "matched" and [m.prefill.key for m in ms] == [FAN[1]]
    s.complete(FAN[1])
    assert s.flow_ended(ms[0].prefill) is True  # the only flow left: the blocks go with it
    # every flow gone before the prefill: it is freed at once, not held for its lease
    fan_reg(s, 0, tid="u")
    s.cancel(flow_key("u", 0, 2))
    assert s.add_prefill(fp("u"))[0] == "dead" and s.idle()


def test_another_shape_of_the_same_transfer_id_is_a_duplicate_and_an_abort_refuses_every_flow():
    s = SenderState(lease_s=5)
    fan_reg(s, 0)
    three = tuple(flow_key("t", d, 3) for d in range(3))
    assert s.add_registration(Register("t", "x", "agentx", [1]), b"x", 5.0, three[2], three)[0] == "duplicate"
    assert s.add_registration(Register("t", "x", "agentx", [1]), b"x", 5.0)[0] == "duplicate"
    assert s.add_registration(Register("t", "x", "agentx", [1]), b"x", 5.0, "t\x009", FAN)[0] == "duplicate"
    prs = s.abort_prefill("t")
    assert [pr.key for pr in prs] == [FAN[0]]
    assert fan_reg(s, 1)[0] == "aborted"  # the rank whose registration comes later, too
    s2 = SenderState(lease_s=5)
    assert s2.abort_prefill("v") == []
    assert fan_reg(s2, 0, tid="v")[0] == "aborted" and fan_reg(s2, 1, tid="v")[0] == "aborted"


def test_a_cancel_naming_no_flow_of_a_fanned_transfer_touches_nothing():
    s = SenderState(lease_s=5)
    fan_reg(s, 0)
    assert s.cancel("t")[0] == "unregistered" and s.status_of("t") is None  # e.g. a D without a Hello
    status, ms = s.add_prefill(fp("t"))
    assert status == "matched" and len(ms) == 1  # rank 0's flow starts; rank 1's waits for it
    assert s.cancel("t")[0] == "unregistered"  # after the split, too
    assert fan_reg(s, 1)[0] == "matched"


def test_a_d_of_another_tp_size_never_takes_a_flow_after_the_split():
    s = SenderState(lease_s=5)
    s.add_prefill(fp("t"))
    two = tuple(flow_key("t", d, 2, 2) for d in range(2))
    four = tuple(flow_key("t", d, 4, 4) for d in range(4))
    assert s.add_registration(Register("t", "a", "a0", [1]), b"a0", 5.0, two[0], two)[0] == "matched"
    assert four[1] != two[1]
    assert s.add_registration(Register("t", "b", "b1", [1]), b"b1", 5.0, four[1], four)[0] == "duplicate"
    assert s.add_registration(Register("t", "b", "b2", [1]), b"b2", 5.0, four[2], four)[0] == "duplicate"
    assert s.add_registration(Register("t", "a", "a1", [1]), b"a1", 5.0, two[1], two)[0] == "matched"


def test_one_flow_ended_twice_frees_the_blocks_only_at_the_last_flow():
    s = SenderState(lease_s=5)
    fan_reg(s, 0)
    fan_reg(s, 1)
    _, (m0, m1) = s.add_prefill(fp("t"))
    s.complete(m0.prefill.key)
    assert s.flow_ended(m0.prefill) is False
    assert s.flow_ended(m0.prefill) is False  # a second release of flow 0: m1 still writes
    s.complete(m1.prefill.key)
    assert s.flow_ended(m1.prefill) is True


def test_a_transfer_id_with_a_nul_is_never_a_prefill():
    s = SenderState(lease_s=5)
    assert s.add_prefill(fp(flow_key("t", 1, 2)))[0] == "duplicate"  # the caller frees it at once
    assert s.idle()


def test_a_keyless_prefill_never_takes_a_keyed_registration_in_either_order():
    """Issue 32, finding 1: a P leg without the transfer key that names a victim's transfer
    id gets nothing of the victim's: its prefill is refused (blocks freed), the victim's
    registration waits on and matches the victim's own prefill."""
    key = "k" * 24
    s = SenderState(lease_s=5)
    # the victim's registration first, then the stranger's keyless prefill (a prefix-cache hit)
    assert s.add_registration(Register("v", "d-v", "agent", [1], transfer_key=key), b"victim-d", 5.0) == ("waiting", None)
    assert s.add_prefill(FinishedPrefill("p-evil", "v", [7])) == ("refused", [])
    assert s.registered_by("v") == b"victim-d" and s.holder("v") is None
    status, (m,) = s.add_prefill(FinishedPrefill("p-v", "v", [8], transfer_key=key))
    assert status == "matched" and m.prefill.request_id == "p-v" and m.registration.reply_to == b"victim-d"
    # the stranger's keyless prefill first: the victim's registration displaces it
    assert s.add_prefill(FinishedPrefill("p-evil", "w", [7])) == ("waiting", [])
    assert s.add_registration(Register("w", "d-w", "agent", [1], transfer_key=key), b"victim-d", 5.0) == ("waiting", None)
    assert [f.request_id for f in s.take_refused()] == ["p-evil"] and s.take_refused() == []
    status, (m,) = s.add_prefill(FinishedPrefill("p-w", "w", [8], transfer_key=key))
    assert status == "matched" and m.prefill.request_id == "p-w"


def test_a_keyless_prefill_never_takes_keyed_fanned_out_registrations():
    key = "k" * 24
    s = SenderState(lease_s=5)
    keys = tuple(flow_key("t", d, 2, 2) for d in (0, 1))
    assert s.add_registration(Register("t", "d0", "agent", [1], transfer_key=key), b"d0", 5.0, keys[0], keys)[0] == "waiting"
    assert s.add_prefill(FinishedPrefill("p-evil", "t", [7])) == ("refused", [])
    status, ms = s.add_prefill(FinishedPrefill("p-t", "t", [8], transfer_key=key))
    assert status == "matched" and [m.prefill.request_id for m in ms] == ["p-t"]
    # prefill whole and keyless first, then a keyed flow registers: the prefill goes
    s2 = SenderState(lease_s=5)
    assert s2.add_prefill(FinishedPrefill("p-evil", "t", [7])) == ("waiting", [])
    assert s2.add_registration(Register("t", "d0", "agent", [1], transfer_key=key), b"d0", 5.0, keys[0], keys)[0] == "waiting"
    assert [f.request_id for f in s2.take_refused()] == ["p-evil"]
    assert s2.add_registration(Register("t", "d1", "agent", [1], transfer_key=key), b"d1", 5.0, keys[1], keys)[0] == "waiting"
    status, ms = s2.add_prefill(FinishedPrefill("p-t", "t", [8], transfer_key=key))
    assert status == "matched" and len(ms) == 2


def test_another_ds_cancel_of_a_flow_nobody_registered_does_not_take_the_owners_registration():
    """Issue 32, finding 5: with D's TP above P's, a Cancel keyed per D rank from another
    trusted D touches nothing of the owner: neither a prefill that waits whole under the
    transfer id nor the owner's later registration (which used to be a duplicate)."""
    s = SenderState(lease_s=5)
    s.add_prefill(fp("t"))  # waits whole: flows are keyed per D rank only once D registers
    assert s.cancel(FAN[0], b"mallory") == ("unregistered", None, None) and s.holder("t") == "p-t"
    assert fan_reg(s, 0, ident=b"owner")[0] == "matched"
    # nothing here at all: the record binds to the canceller, so the owner still registers
    s2 = SenderState(lease_s=5)
    assert s2.cancel(FAN[0], b"mallory")[0] == "cancelled"
    assert fan_reg(s2, 0, ident=b"owner")[0] == "waiting"
    # the canceller's own late Register is still refused (what the record is for)
    s3 = SenderState(lease_s=5)
    assert s3.cancel("x", b"d1")[0] == "cancelled"
    assert s3.add_registration(reg("x"), b"d1", 5.0)[0] == "duplicate"
    assert s3.add_registration(reg("x"), b"d2", 5.0)[0] == "waiting"


def test_a_cancel_of_an_unseen_transfer_kills_neither_the_prefill_nor_a_fanned_owner():
    """After review: a stranger's Cancel of a transfer id P has not seen (equal TP: the
    bare id; D's TP above P's: the bare id from a D without a handshake) must not make the
    owner's prefill "dead" nor the owner's fanned registration a duplicate."""
    s = SenderState(lease_s=5)
    assert s.cancel("t", b"mallory")[0] == "cancelled"
    assert s.add_prefill(fp("t")) == ("waiting", [])  # waits for its registration or lease
    assert add_reg(s, "t", ident=b"owner")[0] == "matched"
    s2 = SenderState(lease_s=5)
    assert s2.cancel("t", b"mallory")[0] == "cancelled"
    assert fan_reg(s2, 0, ident=b"owner")[0] == "waiting"
    status, ms = s2.add_prefill(fp("t"))
    assert status == "matched" and [m.registration.reply_to for m in ms] == [b"owner"]
    # the canceller's own record still ends things for itself
    s3 = SenderState(lease_s=5)
    s3.cancel("u", b"d1")
    assert s3.add_registration(reg("u"), b"d1", 5.0)[0] == "duplicate"
