"""D's receiver state machine (``ReceiverState``): releases, giving up without freeing,
heartbeats and the control connection's hold, cancels, duplicates, a restarted P, when
D spins, a request of several flows (P's TP size above D's). P's side
(``SenderState``): test_push_state.py."""

from kvpath.connector.recv_state import ReceiverState
from tests.connector.state_doubles import Clock


def rstate(c, live=3.0, wait=10.0, grace=1.0):
    return ReceiverState(live, wait, grace, clock=c)


def sent(r, rid, tid, instance="i1"):
    assert r.add(rid, tid, "h:1")
    assert r.on_sent(tid, instance)


def p_agents(peer, instance):
    """The NIXL agents of P process ``instance`` at ``peer`` (what its Welcome named)."""
    return {f"{instance}-lane0"}


class Drained:
    """The fence's view of P's connections: open until the test closes them."""

    def __init__(self):
        self.closed: set[str] = set()
        self.asked: list[tuple[str, str]] = []

    def __call__(self, peer, instance):
        self.asked.append((peer, instance))
        return instance in self.closed


def test_receiver_success_releases_once_without_failure():
    r = rstate(Clock())
    sent(r, "d1", "t1")
    r.on_done("t1", "i1-lane0", p_agents)
    assert r.take() == ({"d1"}, set())
    assert r.take() == (set(), set())


def test_giving_up_never_frees_blocks_while_ps_connections_can_still_deliver():
    c, drained = Clock(), Drained()
    r = rstate(c)
    sent(r, "d1", "t1")
    c.t = 3.0  # P silent for the liveness timeout: D gives up (Cancel) but holds the blocks
    gave_up, released = r.expire(drained)
    assert [w.request_id for w in gave_up] == ["d1"] and not released
    assert [w.transfer_id for w in r.to_cancel()] == ["t1"]
    for t in (10.0, 100.0, 1000.0):  # no timer ever frees them
        c.t = t
        r.expire(drained)
        assert r.take() == (set(), set())
    drained.closed.add("i1")  # P's process is gone: its connections closed and were read
    c.t = 1000.5
    r.expire(drained)
    assert r.take() == (set(), set())  # keep progressing for the grace
    c.t = 1001.5
    r.expire(drained)
    assert r.take() == ({"d1"}, {"d1"})
    assert ("h:1", "i1") in drained.asked


def test_a_push_that_completes_after_d_gave_up_is_a_success():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1")
    c.t = 10.0  # max_wait passed (P alive, busy writing)
    r.on_alive("t1")
    assert [w.why for w in r.expire(Drained())[0]] == ["max_wait_s passed"]
    r.on_done("t1", "i1-lane0", p_agents)  # the WRITE went on and finished: the KV is there
    assert r.take() == ({"d1"}, set())


def test_heartbeats_keep_a_registration_alive_until_max_wait():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1")
    for t in (2.0, 4.0, 6.0, 8.0):
        c.t = t
        r.on_alive("t1")
        assert r.expire(Drained()) == ([], [])
    c.t = 10.0
    assert [w.why for w in r.expire(Drained())[0]] == ["max_wait_s passed"]
    assert r.take() == (set(), set())  # P alive: its answer to the Cancel decides


def test_p_saying_never_posted_releases_at_once_and_a_broken_write_after_the_grace():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1")
    sent(r, "d2", "t2")
    r.on_ended("t1", posted=False, instance="i1")
    assert r.take() == ({"d1"}, {"d1"})
    c.t = 1.0
    r.on_ended("t2", posted=True, instance="i1")  # UCX failed the WRITE: its connection is broken
    assert r.take() == (set(), set()) and not r.to_cancel()
    c.t = 1.99
    r.expire(Drained())
    assert r.take() == (set(), set())
    c.t = 2.0
    r.expire(Drained())
    assert r.take() == ({"d2"}, {"d2"})


def test_cancelled_request_is_released_not_failed_and_unsent_ones_at_once():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1")
    r.cancel_request("d1")
    assert r.take() == (set(), set()) and [w.transfer_id for w in r.to_cancel()] == ["t1"]
    r.on_ended("t1", posted=False, instance="i1")  # P confirmed the cancel
    assert r.take() == ({"d1"}, set())
    r.add("d2", "t2", "h:1")  # queued behind a handshake: P cannot know it
    r.cancel_request("d2")
    assert r.take() == ({"d2"}, set())


def test_duplicate_transfer_id_is_rejected_at_once_and_a_restart_waits_for_the_old_connections():
    c, drained = Clock(), Drained()
    r = rstate(c)
    sent(r, "d1", "t1", instance="old")
    assert not r.add("d2", "t1", "h:1")
    r.reject_new("d2")
    assert r.take() == ({"d2"}, {"d2"})
    r.add("d3", "t3", "h:1")  # not sent yet: goes to the new P process
    assert [w.request_id for w in r.peer_restarted("h:1")] == ["d1"]
    r.expire(drained)
    assert r.take() == (set(), set())
    drained.closed.add("old")
    r.expire(drained)
    c.t = 1.0
    r.expire(drained)
    assert r.take() == ({"d1"}, {"d1"}) and r.pending() == 1


def test_unknown_peer_answer_unsends_and_a_notification_without_registration_is_stray():
    r = rstate(Clock())
    sent(r, "d1", "t1")
    assert r.on_unknown_peer("t1").sent is False  # re-sent after the new handshake
    assert r.on_done("t9", "i1-lane0", p_agents) is None  # no registration waits for it: dropped
    r.add("d9", "t9", "h:1")
    assert r.take() == (set(), set())  # never a success by a notification that came first


def test_d_spins_only_while_a_posted_push_should_be_moving():
    c = Clock()
    r = rstate(c)
    assert r.progress_need() == "idle"
    r.add("d1", "t1", "h:1")
    assert r.progress_need() == "fast"  # queued behind the handshake: P probes our lanes
    r.on_sent("t1")
    assert r.progress_need() == "idle"  # waiting for P's prefill: nothing moves
    r.on_posted("t1", nbytes=10_000_000)  # ~10 ms at 1 GB/s, plus 5 ms
    assert r.progress_need() == "spin"
    c.t = 0.016
    assert r.progress_need() == "fast"  # slower than expected: keep progressing, not spinning
    r.on_done("t1", "-lane0", p_agents)
    assert r.progress_need() == "idle"


def test_a_request_with_several_flows_is_released_when_its_last_flow_lands():
    c = Clock()
    r = rstate(c)
    assert r.add("d1", "t1", ["p:1", "p:2"])  # P TP 2 -> D TP 1: one flow from each P rank
    assert not r.add("d2", "t1", ["p:3"])  # the transfer id is taken, whatever the peer
    assert r.on_sent("t1", "i1", "p:1") and r.on_sent("t1", "i2", "p:2")
    assert r.pending() == 2 and r.get("t1") is None  # two flows: a peer must be named

    def agents(peer, instance):
        return {f"{instance}-lane0"}

    assert r.on_done("t1", "i2-lane0", agents).peer == "p:2"  # the flow is told by its sender's agent
    assert r.take() == (set(), set()) and r.pending() == 1  # p:1's heads are not here yet
    assert r.on_done("t1", "i2-lane0", agents) is None  # that flow ended: a repeat is stray
    assert r.on_done("t1", "i1-lane0", agents).peer == "p:1"
    assert r.take() == ({"d1"}, set()) and r.pending() == 0


def test_one_failed_flow_fails_the_request_and_gives_up_its_other_flows():
    c, drained = Clock(), Drained()
    r = rstate(c)
    assert r.add("d1", "t1", ["p:1", "p:2"])
    r.on_sent("t1", "i1", "p:1")
    r.on_sent("t1", "i2", "p:2")
    r.on_posted("t1", 1 << 20, peer="p:2")
    # P rank 0 never posted (its prefill was aborted): that flow ends at once
    assert r.on_ended("t1", False, "rejected: aborted", instance="i1", peer="p:1")[0] == "released"
    w = r.get("t1", "p:2")
    assert w.gave_up and "another flow of the request failed" in w.why
    assert r.take() == (set(), set())  # p:2's WRITE may still land in the blocks: held
    assert [x.peer for x in r.to_cancel()] == ["p:2"]  # P rank 1 is asked to stop at once
    # P rank 1's posted WRITE ended (failed): its fence holds the blocks grace_s longer
    assert r.on_ended("t1", True, "failed", instance="i2", peer="p:2")[0] == "fenced"
    c.t = 0.5
    r.expire(drained)
    assert r.take() == (set(), set())
    c.t = 1.5
    r.expire(drained)
    assert r.take() == ({"d1"}, {"d1"})  # failed, released once, after the last flow's fence


def test_a_cancelled_request_gives_up_every_flow():
    c = Clock()
    r = rstate(c)
    assert r.add("d1", "t1", ["p:1", "p:2"])
    r.on_sent("t1", "i1", "p:1")  # p:2's Register has not left D yet
    assert {w.peer for w in r.cancel_request("d1")} == {"p:1", "p:2"}
    assert r.take() == (set(), set()) and r.pending() == 1  # the unsent flow ended at once
    assert r.on_ended("t1", False, "cancelled", instance="i1", peer="p:1")[0] == "released"
    assert r.take() == ({"d1"}, set())  # D's own request ended: released, not failed


def test_a_second_registration_of_a_live_request_never_releases_it():
    c = Clock()
    r = rstate(c)
    assert r.add("d1", "t1", ["p:1", "p:2"])
    r.on_sent("t1", "i1", "p:1")
    r.reject_new("d1")  # e.g. refused again (an untrusted key, a bad port): its flows still wait
    assert r.take() == (set(), set()) and r.pending() == 2
    r.reject_new("d2")  # a request with nothing waiting is failed and freed at once
    assert r.take() == ({"d2"}, {"d2"})


def test_a_live_control_connection_holds_the_liveness_clock_until_max_wait_and_a_drop_ends_the_hold():
    c, drained = Clock(), Drained()
    r = rstate(c)  # liveness 3 s, max_wait 10 s
    for rid, tid in (("d1", "t1"), ("d2", "t2")):
        assert r.add(rid, tid, "h:1") and r.on_sent(tid, "i1", epoch=1)
    conn = {"h:1": 1}  # P's process answers its ZMTP heartbeats on connection 1; its Python sends nothing
    alive = conn.get
    for t in (3.0, 5.0, 7.0, 9.5):
        c.t = t
        assert r.expire(drained, alive) == ([], [])
    assert r.transport_holds == 2  # each flow counted once
    r.on_done("t1", "i1-lane0", p_agents)  # the busy P's push lands after all
    assert r.take() == ({"d1"}, set())
    c.t = 10.0  # max_wait_s bounds the hold
    assert [w.why for w in r.expire(drained, alive)[0]] == ["max_wait_s passed"]
    # another flow: the connection drops (P's process stopped): P silent within the hold's step
    assert r.add("d3", "t3", "h:1") and r.on_sent("t3", "i1", epoch=1)
    c.t = 13.5
    assert r.expire(drained, alive) == ([], [])
    del conn["h:1"]
    c.t = 14.0
    assert r.expire(drained, alive)[0] == []  # the hold's second is not over
    c.t = 14.6
    assert [w.why for w in r.expire(drained, alive)[0]] == ["P silent"]
    # a registration not sent yet (P's Welcome waits for its lane set-up) is held too,
    # up to max_wait_s; without the connection it ends at its clock
    r.add("d4", "t4", "h:1")
    r.add("d5", "t5", "h:2")
    conn["h:1"] = 2
    c.t = 20.0
    gave_up, _ = r.expire(drained, alive)
    assert [w.request_id for w in gave_up] == ["d5"]
    c.t = 24.7
    assert [w.why for w in r.expire(drained, alive)[0]] == ["max_wait_s passed"]


def test_the_hold_trusts_only_the_connection_p_last_spoke_on():
    c, drained = Clock(), Drained()
    r = rstate(c)
    assert r.add("d1", "t1", "h:1") and r.on_sent("t1", "i1", epoch=1)
    assert r.add("d2", "t2", "h:1") and r.on_sent("t2", "i1", epoch=1)
    conn = {"h:1": 2}  # the connection dropped and came back: what went out on 1 may be lost
    r.on_alive("t2", "h:1", epoch=2)  # P's heartbeat for t2 on the new connection
    c.t = 3.5
    gave_up, _ = r.expire(drained, conn.get)
    assert [w.request_id for w in gave_up] == ["d1"]  # t1: never heard of on 2, not held
    c.t = 6.0
    assert r.expire(drained, conn.get) == ([], [])  # t2: held
