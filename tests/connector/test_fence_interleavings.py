"""The fence under hostile interleavings, each one replayed deterministically.

Safety invariant: no NIXL WRITE ever lands in a block D has released to vLLM. D
fences before it frees; P never frees source blocks while a WRITE may be in
flight. Every test drives the pure state machines (``ReceiverState`` on D,
``SenderState`` on P) or one method of the engine threads built without sockets
or NIXL (fakes stand in for the ZMQ socket and the NIXL agent), on a fake clock.

The drain check (D's view of P's lane connections) and the time bound when it cannot
tell: test_fence_interleavings_drain.py.
"""

from __future__ import annotations

from kvpath.connector import messages as M
from kvpath.connector.lane_setup import Peer
from kvpath.connector.lanes import LaneSet
from kvpath.connector.push_state import FinishedPrefill, SenderState
from kvpath.connector import recv_state
from tests.connector.engine_doubles import LAY, FakeAgent, FakeDealer
from tests.connector.state_doubles import PEER, Clock, never_drained, receiver, rstate, sender, sent


def register(tid: str) -> M.Register:
    return M.Register(tid, "d" + tid[1:], "d-agent", [1, 2])  # request d1 waits for transfer t1


# -- 1. a restarted P, crossing acks -------------------------------------------
def test_restarted_p_answering_a_cancel_it_never_saw_does_not_release():
    """Old P (pA) may still have the WRITE's bytes on the wire; the new P (pB) knows
    nothing of the transfer. Its "cancelled, never posted" must not free the blocks."""
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1", instance="pA")
    outcome, w = r.on_ended("t1", posted=False, why="cancelled", instance="pB")
    assert outcome == "ignored" and w is not None
    assert r.take() == (set(), set()) and r.pending() == 1
    # An answer without an instance (an older P) is no proof either.
    assert r.on_ended("t1", posted=False, instance="")[0] == "ignored"
    assert r.take() == (set(), set())
    # The process it was sent to answering "never posted" does release.
    assert r.on_ended("t1", posted=False, instance="pA")[0] == "released"
    assert r.take() == ({"d1"}, {"d1"})


def test_restarted_p_end_to_end_cancel_answer_is_ignored_and_a_late_register_refused():
    c = Clock()
    rcv, link = receiver(c)
    sent(rcv.state, "d1", "t1", instance="pA")
    new_p = sender("pB")
    new_p.flows.on_cancel(b"d", "t1")  # the Cancel reached the new process
    ident, ack = new_p.channel.router.out[-1]
    assert (ack.status, ack.posted, ack.instance) == ("cancelled", False, "pB")
    rcv.on_ack(link, ack)
    assert rcv.state.take() == (set(), set())  # held: pA's bytes may still land
    assert rcv.stats.totals["acks_ignored"] == 1
    # pB recorded the transfer as cancelled: a Register arriving late is refused.
    assert new_p.state.add_registration(register("t1"), b"d", post_by=1e9)[0] == "duplicate"
    assert new_p.state.final("t1") == ("cancelled", False)


def test_p_answers_a_cancel_for_a_finished_transfer_with_its_record():
    """The WRITE failed after it was posted; D's Cancel crossed the failure Ack. P must
    not overwrite its record with "cancelled, never posted"."""
    s = SenderState(lease_s=5)
    s.add_registration(register("t1"), b"d", 5.0)
    s.add_prefill(FinishedPrefill("p1", "t1", [3, 4]))
    s.complete("t1", "failed", posted=True)
    assert s.cancel("t1")[0] == "done"
    assert s.status_of("t1") == "failed" and s.final("t1") == ("failed", True)
    s.add_registration(register("t2"), b"d", 5.0)
    s.add_prefill(FinishedPrefill("p2", "t2", [3, 4]))
    s.complete("t2")  # a push that completed: posted
    assert s.cancel("t2")[0] == "done" and s.final("t2") == ("ok", True)


def test_crossing_cancelled_and_failed_posted_acks_keep_the_grace():
    c = Clock()
    rcv, link = receiver(c, grace=1.0)
    sent(rcv.state, "d1", "t1", instance="pA")
    p = sender("pA")
    p.state.add_registration(register("t1"), b"d", 5.0)
    p.state.add_prefill(FinishedPrefill("p1", "t1", [3, 4]))
    p.state.complete("t1", "failed", posted=True)  # UCX: ERR
    rcv.on_ack(link, M.Ack("t1", "failed", "broken", posted=True, instance="pA"))
    p.flows.on_cancel(b"d", "t1")  # D's Cancel, sent before the failure arrived
    ack = p.channel.router.out[-1][1]
    assert (ack.status, ack.posted) == ("failed", True)
    rcv.on_ack(link, ack)
    # An older P's answer ("cancelled, never posted") must not cut the grace short either.
    rcv.on_ack(link, M.Ack("t1", "cancelled", posted=False, instance="pA"))
    assert rcv.state.take() == (set(), set())
    c.t = 0.99
    rcv.state.expire(never_drained)
    assert rcv.state.take() == (set(), set())
    c.t = 1.0
    rcv.state.expire(never_drained)
    assert rcv.state.take() == ({"d1"}, {"d1"})


def test_a_never_posted_answer_after_a_posted_ack_does_not_release():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1", instance="pA")
    r.on_posted("t1", nbytes=1000)  # the WRITE is (or will be) moving
    assert r.on_ended("t1", posted=False, instance="pA")[0] == "ignored"
    assert r.take() == (set(), set())
    r.on_done("t1", "pA-lane0", lambda peer, inst: {"pA-lane0"})
    assert r.take() == ({"d1"}, set())


# -- 2. Cancel is re-sent with back-off until P answers --------------------------
def test_cancel_is_resent_with_backoff_until_the_bound():
    c = Clock()
    r = rstate(c, live=3.0)
    sent(r, "d1", "t1")
    c.t = 3.0
    r.expire(never_drained)
    sends = []
    for t in [3.0, 3.1, 3.25, 3.5, 3.75, 4.0, 4.75, 5.0, 6.0, 6.75, 7.0, 50.0]:
        c.t = t
        if r.to_cancel():
            sends.append(t)
    # 0.25 s doubling from the first Cancel; none after liveness_s (3 s) since it.
    assert recv_state.CANCEL_RETRY_FIRST_S == 0.25 and sends == [3.0, 3.25, 3.75, 4.75]
    assert r.take() == (set(), set())  # the drain fence decides now


def test_cancel_stops_on_any_final_answer():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1", instance="pA")
    r.cancel_request("d1")
    assert [w.transfer_id for w in r.to_cancel()] == ["t1"]
    r.on_ended("t1", posted=False, instance="pB")  # a final answer, though ignored
    c.t = 10.0
    assert r.to_cancel() == []


def test_send_cancels_resends_through_the_socket():
    c = Clock()
    rcv, link = receiver(c)
    sent(rcv.state, "d1", "t1")
    rcv.cancel("d1")
    for t in (0.0, 0.1, 0.25):
        c.t = t
        rcv.send_cancels()
    assert [type(m).__name__ for m in link.sock.out] == ["Cancel", "Cancel"]


# -- 3. _flush's check-then-send race with an abort --------------------------------
def test_pure_state_abort_after_marking_sent_fences():
    c = Clock()
    r = rstate(c)
    assert r.add("d1", "t1", PEER)
    assert r.on_sent("t1", "pA")  # checked and marked in one step, before the send
    r.cancel_request("d1")  # the abort lands while the Register is on its way
    assert r.take() == (set(), set())
    assert [w.transfer_id for w in r.to_cancel()] == ["t1"]
    r.cancel_request("d2")
    r.add("d2", "t2", PEER)
    r.cancel_request("d2")
    assert not r.on_sent("t2", "pA")  # given up while queued: not sent at all


def test_flush_abort_between_check_and_send_does_not_release_as_never_sent():
    c = Clock()
    rcv, link = receiver(c)
    rcv.state.add("d1", "t1", PEER)
    link.queued.append(register("t1"))
    link.sock = FakeDealer(on_send=lambda: rcv.cancel("d1"))  # the engine thread aborts mid-send
    rcv.flush(link)
    assert [m.transfer_id for m in link.sock.out] == ["t1"]  # P gets the Register...
    assert rcv.state.take() == (set(), set())  # ...so the blocks stay fenced
    assert [w.transfer_id for w in rcv.state.to_cancel()] == ["t1"]


def test_flush_send_failure_ends_as_not_posted():
    c = Clock()
    rcv, link = receiver(c)
    rcv.state.add("d1", "t1", PEER)
    rcv.state.add("d2", "t2", PEER)
    link.queued += [register("t1"), register("t2")]
    link.sock = FakeDealer(on_send=lambda: rcv.cancel("d2") if not link.sock.out else None, full=True)
    rcv.flush(link)
    # Never queued, so P cannot know them: d1 failed, d2 (aborted meanwhile) released.
    assert rcv.state.take() == ({"d1", "d2"}, {"d1"})


def test_never_sent_registrations_are_released_at_once():
    """Release 6: P cannot know of a registration that never left D."""
    c = Clock()
    r = rstate(c, live=3.0)
    sent(r, "d1", "t1")
    r.cancel_request("d1")
    r.on_unknown_peer("t1")  # the Register reached a P without our handshake: dropped there
    assert r.take() == ({"d1"}, set())
    r.add("d2", "t2", PEER)  # queued behind a handshake that never completes
    c.t = 3.0
    r.expire(never_drained)
    assert r.take() == ({"d2"}, {"d2"})
    r.add("d3", "t3", PEER)
    r.fail_unsent(PEER, "handshake refused")
    assert r.take() == ({"d3"}, {"d3"})


# -- 4. notifications only from the registration's P process -----------------------
def test_a_stray_notification_before_the_registration_is_dropped():
    c = Clock()
    r = rstate(c)
    agents = lambda peer, inst: {"pA-lane0"}  # noqa: E731
    assert r.on_done("t9", "pA-lane0", agents) is None
    assert r.add("d9", "t9", PEER) and r.on_sent("t9", "pA")
    assert r.take() == (set(), set())  # not a success on arrival
    assert r.on_done("t9", "pA-lane0", agents).request_id == "d9"
    assert r.take() == ({"d9"}, set())


def test_a_notification_from_another_agent_is_dropped():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1", instance="pA")
    agents = {("h:1", "pA"): {"pA-lane0"}, ("h:1", "pB"): {"pB-lane0"}}
    look = lambda peer, inst: agents.get((peer, inst), set())  # noqa: E731
    assert r.on_done("t1", "pB-lane0", look) is None  # a restarted P's agent
    assert r.on_done("t1", "evil", look) is None
    assert r.take() == (set(), set()) and r.pending() == 1
    assert r.on_done("t1", "pA-lane0", look) is not None
    assert r.take() == ({"d1"}, set())


def test_poll_notifs_counts_stray_ones():
    c = Clock()
    rcv, link = receiver(c)
    sent(rcv.state, "d1", "t1", instance="pA")
    rcv.agent = FakeAgent("d-agent", {"evil": [M.make_notif("t1")], "pA-lane0": [M.make_notif("t2"),
                                                                                 M.make_notif("t1")]})
    rcv.poll_notifs()
    assert rcv.state.take() == ({"d1"}, set())
    assert rcv.stats.totals["notifs_stray"] == 2 and rcv.stats.totals["recv_ok"] == 1


def test_welcome_names_the_lane_agents_and_d_keeps_them_per_instance():
    p = sender("pA")
    hello = M.Hello("d", "d-agent", b"m", LAY, M.Compat(), "dI", 1.0)
    lanes = LaneSet(hello, [FakeAgent("pA-lane0"), FakeAgent("pA-lane1"), FakeAgent("pA-spare")], 0, 0, 2)
    p.lanes.welcome(Peer(hello, b"d", lanes))
    welcome = p.channel.router.out[-1][1]
    assert welcome.agents == ["pA-lane0", "pA-lane1"] and welcome.instance == "pA"
    rcv, link = receiver(Clock())
    link.agents.clear()
    rcv.on_welcome(link, M.decode_to_decode(M.encode(welcome)))
    assert link.agents == {"pA": {"pA-lane0", "pA-lane1"}}


def test_a_cancel_cannot_free_a_prefill_nobody_registered_and_forgotten_records_answer_posted():
    s = SenderState(lease_s=5, remember=2)
    s.add_prefill(FinishedPrefill("p1", "t1", [1]))
    assert s.cancel("t1")[0] == "unregistered" and "t1" in s.prefills  # waits for its registration or lease
    for i in range(3):  # the memory of ended transfers is bounded: one record is forgotten
        s.cancel(f"x{i}")
    assert s.forgotten == 1
    status, fp, pr = s.cancel("never-seen-or-forgotten")
    assert status == "cancelled" and s.final("never-seen-or-forgotten") == ("cancelled", True)


def test_a_register_left_queued_by_an_ended_request_is_never_sent_for_the_next_one():
    """Request d1's Register waits on a link; d1 ends before it leaves (freed at once,
    never sent), and d2 reuses the transfer id. d1's Register names d1's blocks, which
    vLLM has freed: sending it for d2's flow would have P write into them."""
    c = Clock()
    rcv, link = receiver(c)
    rcv.state.add("d1", "t1", PEER)
    link.queued.append(register("t1"))  # request d1, blocks [1, 2]
    rcv.state.cancel_request("d1")
    assert rcv.state.take() == ({"d1"}, set())  # never sent: released at once
    rcv.state.add("d2", "t1", PEER)
    link.queued.append(M.Register("t1", "d2", "d-agent", [5, 6]))
    rcv.flush(link)
    assert [(m.request_id, m.block_ids) for m in link.sock.out] == [("d2", [5, 6])]


def test_a_flow_whose_start_raises_fails_alone_and_its_sibling_still_starts():
    """D TP 2 above P TP 1: one prefill, two flows. Starting the first raises (a bug, a
    NIXL error outside its own handling): that flow fails (D hears it, nothing was
    posted), the second still starts, and the blocks wait for the second flow."""
    from kvpath.connector.push_state import flow_key

    snd = sender("pA")
    keys = tuple(flow_key("t1", d, 2, 2) for d in range(2))
    for d in range(2):
        snd.state.add_registration(M.Register("t1", "d1", f"agent{d}", [1]), b"d%d" % d, 1e9, keys[d], keys)
    started = []

    def start(m):
        if m.prefill.key == keys[0]:
            raise RuntimeError("boom")
        started.append(m)

    snd.writes.start = start
    snd.flows.on_finished(FinishedPrefill("p1", "t1", [3, 4]))
    assert [m.prefill.key for m in started] == [keys[1]] and snd.state.final(keys[0]) == ("failed", False)
    assert [(ident, msg.status) for ident, msg in snd.channel.router.out] == [(b"d0", "failed")]
    assert snd.take_finished() == set()  # the second flow still reads the blocks
    snd.state.complete(keys[1])  # the second flow's WRITE landed
    snd.freed.release(started[0].prefill)
    assert snd.take_finished() == {"p1"}
