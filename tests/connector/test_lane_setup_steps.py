"""Lane set-up runs on the writer's loop one probe poll at a time: a D whose probes
never complete (a firewall dropping its packets) delays nobody else's acks, and
leaves no remote agent behind when it fails."""

import time

import pytest

from kvpath.connector import lanes as lanes_mod
from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.lane_setup import Peer
from kvpath.connector.lanes import LaneSet
from kvpath.connector.sender import PushSender
from tests.connector.engine_doubles import bare_sender
from tests.connector.test_peer_bounds import LAY, NoEntropy, hello


class SlowAgent:
    """A lane agent whose probes to ``stuck`` D agents never complete."""

    def __init__(self, name, stuck=()):
        self.name, self.stuck = name, set(stuck)
        self.remote: set[str] = set()
        self.polls = 0

    def add_remote_agent(self, metadata):
        self.remote.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name):
        self.remote.discard(name)

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, loc, rem, remote, notif=b""):
        return remote

    def transfer(self, handle):
        return "PROC" if handle in self.stuck else "DONE"

    def check_xfer_state(self, handle):
        self.polls += 1
        return self.transfer(handle)

    def release_xfer_handle(self, handle):
        pass


def writer(agents) -> PushSender:
    snd = bare_sender(KVPathConfig(control_plaintext=True, lanes=2), LAY, agents)
    assert snd.channel.address.endswith(":5600")
    return snd


@pytest.fixture(autouse=True)
def no_entropy(monkeypatch):
    monkeypatch.setattr(lanes_mod, "TcpSocketEntropy", NoEntropy)


def welcomes(snd, ident):
    return [m for i, m in snd.channel.router.out if i == ident and isinstance(m, M.Welcome)]


def test_a_stuck_probe_does_not_hold_the_writer_and_others_are_answered_meanwhile():
    agents = [SlowAgent("a0", stuck={"d-stuck"}), SlowAgent("a1", stuck={"d-stuck"})]
    snd = writer(agents)
    # D "ok" already has lanes: its registration must be answered while d-stuck's set-up runs
    ok = LaneSet(hello("d-ok"), agents, 0, 5600, 2, entropy=NoEntropy())
    ok.open_all()
    snd.lanes.peers["d-ok"] = Peer(hello("d-ok"), b"d-ok", ok)
    t0 = time.monotonic()
    snd.lanes.on_hello(b"d-stuck", hello("d-stuck"))
    assert time.monotonic() - t0 < 0.5  # returned with its probe in flight
    assert snd.lanes.opening is not None and welcomes(snd, b"d-stuck") == []
    snd.flows.on_register(b"d-ok", M.Register("t1", "r1", "d-ok", [1]))
    assert [m.status for i, m in snd.channel.router.out if i == b"d-ok"] == ["accepted"]
    snd.lanes.on_hello(b"d-stuck", hello("d-stuck"))  # D's re-sent Hello: not a second set-up
    for _ in range(5):
        snd.lanes.step()
    assert agents[0].polls == 5 and len(snd.lanes.queued) == 0


def test_a_set_up_that_times_out_is_refused_leaves_no_remote_agent_and_the_next_one_runs(monkeypatch):
    monkeypatch.setattr(lanes_mod, "PROBE_TIMEOUT_S", 0.05)
    agents = [SlowAgent("a0", stuck={"d-stuck"}), SlowAgent("a1", stuck={"d-stuck"})]
    snd = writer(agents)
    snd.lanes.on_hello(b"d-stuck", hello("d-stuck"))
    snd.lanes.on_hello(b"d-next", hello("d-next"))  # queued behind it
    assert welcomes(snd, b"d-next") == []
    deadline = time.monotonic() + 5
    while snd.lanes.opening is not None and time.monotonic() < deadline:
        snd.lanes.step()
        time.sleep(0.005)
    w = welcomes(snd, b"d-stuck")
    assert len(w) == 1 and not w[0].ok and w[0].field == "lanes"
    assert all("d-stuck" not in a.remote for a in agents)
    snd.lanes.step()  # d-next's set-up: its probes complete at once
    w = welcomes(snd, b"d-next")
    assert len(w) == 1 and w[0].ok and "d-next" in snd.lanes.peers


def test_shutdown_abandons_a_set_up_in_progress_without_leaving_remote_agents():
    agents = [SlowAgent("a0", stuck={"d-stuck"}), SlowAgent("a1", stuck={"d-stuck"})]
    snd = writer(agents)
    snd.lanes.on_hello(b"d-stuck", hello("d-stuck"))
    snd.lanes.on_hello(b"d-q", hello("d-q"))
    snd.lanes.abandon()
    assert snd.lanes.opening is None and not snd.lanes.queued
    assert all(a.remote == set() for a in agents)


def test_a_broken_lane_is_reopened_on_the_loop_while_the_push_takes_a_live_one():
    agents = [SlowAgent("a0", stuck={"d1"}), SlowAgent("a1")]
    snd = writer(agents)
    ls = LaneSet(hello("d1"), agents, 0, 5600, 2, entropy=NoEntropy())
    agents[0].stuck.clear()
    ls.open_all()
    agents[0].stuck.add("d1")  # lane 0's agent cannot reach D any more
    snd.lanes.peers["d1"] = Peer(hello("d1"), b"d1", ls)
    ls.tear_down(0)
    snd.lanes.queue_reopen(snd.lanes.peers["d1"], 0)
    snd.lanes.step()
    assert snd.lanes.opening is not None and snd.lanes.opening.reopen == 0 and ls.lanes[0].broken
    agents[0].stuck.clear()  # D reachable again: the probe completes
    snd.lanes.step()
    assert snd.lanes.opening is None and not ls.lanes[0].broken
    assert [m.ok for i, m in snd.channel.router.out if isinstance(m, M.Welcome)] == [True]  # D told of the new lane


def _hello_listening(port: int, ip: str = "127.0.0.1") -> M.Hello:
    import msgspec

    return msgspec.structs.replace(hello("d-x"), host="127.0.0.1", listen_ports=[port], listen_addrs=[(ip, port)])


def test_reachability_check_passes_on_accept_or_refusal_and_fails_on_silence(monkeypatch):
    import socket

    monkeypatch.setattr(lanes_mod, "PROBE_TIMEOUT_S", 0.3)
    agents = [SlowAgent("a0")]

    def check(h) -> str:
        steps = LaneSet(h, agents, 0, 5600, 1, entropy=NoEntropy()).reachable_steps()
        try:
            while True:
                next(steps)
                time.sleep(0.005)
        except StopIteration:
            return "ok"
        except RuntimeError as e:
            return str(e)

    with socket.socket() as srv:  # accepts (the kernel completes the handshake)
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        assert check(_hello_listening(srv.getsockname()[1])) == "ok"
        closed = srv.getsockname()[1]
    assert check(_hello_listening(closed)) == "ok"  # refused: the host answered, NIXL will not hang
    # silent: a listener whose accept queue is full drops further SYNs (as a firewall would)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        fillers = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.1)
        assert "does not answer" in check(_hello_listening(port, "0.0.0.0"))  # a wildcard listener: D's host
        for c in fillers:
            c.close()


def _all_lanes_broken(snd, agents, name="d1"):
    ls = LaneSet(hello(name), agents, 0, 5600, 2, entropy=NoEntropy())
    ls.open_all()
    snd.lanes.peers[name] = Peer(hello(name), name.encode(), ls)
    for a in agents:
        a.stuck.add(name)  # D unreachable for now
    ls.tear_down(0)
    ls.tear_down(1)
    return ls


def _push(snd, tid, name="d1", post_by_s=60.0):

    from kvpath.connector.push_state import FinishedPrefill

    snd.flows.on_finished(FinishedPrefill("req-" + tid, tid, [1, 2]))
    snd.flows.on_register(name.encode(), M.Register(tid, "dr-" + tid, name, [3, 4], post_by_s=post_by_s,
                                               sent_at=time.time()))


def _acks(snd, tid):
    return [m for i, m in snd.channel.router.out if isinstance(m, M.Ack) and m.transfer_id == tid]


def test_a_push_with_no_lane_open_waits_for_the_reopen_on_the_loop_and_then_goes():
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    ls = _all_lanes_broken(snd, agents)
    t0 = time.monotonic()
    _push(snd, "t1")
    assert time.monotonic() - t0 < 0.5  # parked, not reopened in place (its probe never completes)
    assert list(snd.writes.parked.waiting) == ["d1"]
    (key,) = snd.lanes.reopens
    assert key[0] == "d1"
    assert [m.status for i, m in snd.channel.router.out if i == b"d1" and isinstance(m, M.Ack)] == ["accepted"]
    # meanwhile the writer answers another D
    ok = LaneSet(hello("d-ok"), [SlowAgent("b0"), SlowAgent("b1")], 0, 5600, 2, entropy=NoEntropy())
    ok.open_all()
    snd.lanes.peers["d-ok"] = Peer(hello("d-ok"), b"d-ok", ok)
    snd.flows.on_register(b"d-ok", M.Register("t2", "r2", "d-ok", [1]))
    assert [m.status for i, m in snd.channel.router.out if i == b"d-ok"] == ["accepted"]
    for _ in range(3):
        snd.lanes.step()
    assert snd.writes.parked.waiting and snd.lanes.opening is not None  # still waiting: the probe does not complete
    for a in agents:
        a.stuck.clear()
    snd.lanes.step()
    assert not snd.writes.parked.waiting and not ls.lanes[key[1]].broken
    out = [m for i, m in snd.channel.router.out if i == b"d1"]
    # D learned the reopened lane (Welcome) before the WRITE was posted on it
    kinds = [type(m).__name__ + (f":{m.status}" if isinstance(m, M.Ack) else "") for m in out]
    assert kinds[1:] == ["Welcome", "Ack:posted"], kinds
    assert snd.state.status_of("t1") == "ok" and "req-t1" in snd.take_finished()  # pushed, blocks freed


def test_a_push_waiting_for_a_reopen_that_fails_is_failed_and_its_blocks_freed(monkeypatch):
    monkeypatch.setattr(lanes_mod, "PROBE_TIMEOUT_S", 0.05)
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    _all_lanes_broken(snd, agents)
    _push(snd, "t1")
    assert snd.writes.parked.waiting
    deadline = time.monotonic() + 5
    while (snd.writes.parked.waiting or snd.lanes.opening is not None) and time.monotonic() < deadline:
        snd.lanes.step()
        time.sleep(0.005)
    assert not snd.writes.parked.waiting
    acks = [m for i, m in snd.channel.router.out if i == b"d1" and isinstance(m, M.Ack)]
    assert [a.status for a in acks][-1] == "failed" and "reopening lane" in acks[-1].detail
    assert snd.take_finished() == {"req-t1"}  # P's blocks are freed
    assert snd.state.status_of("t1") == "failed"


def test_shutdown_fails_the_pushes_waiting_for_a_reopen():
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    _all_lanes_broken(snd, agents)
    _push(snd, "t1")
    snd.close()  # P shuts down
    assert not snd.writes.parked.waiting and snd.take_finished() == {"req-t1"}


def _two_lanes_tids(n=2):
    """Transfer ids whose hash lanes (of 2) are 0 and 1."""
    from kvpath.reservation.decisions import default_lane

    out = {}
    i = 0
    while len(out) < n:
        out.setdefault(default_lane(f"t{i}", 2), f"t{i}")
        i += 1
    return out[0], out[1]


def test_pushes_waiting_for_different_lanes_of_one_d_all_go_when_one_lane_reopens(monkeypatch):
    monkeypatch.setattr(lanes_mod, "PROBE_TIMEOUT_S", 0.05)
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    ls = _all_lanes_broken(snd, agents)
    t_a, t_b = _two_lanes_tids()
    _push(snd, t_a)
    _push(snd, t_b)
    assert len(snd.writes.parked.waiting["d1"]) == 2 and len(snd.lanes.reopens) == 2
    for a in agents:
        a.stuck.clear()
    snd.lanes.step()  # lane 0 reopens: both pushes go on it
    assert not snd.writes.parked.waiting and not ls.lanes[0].broken
    assert [a.status for a in _acks(snd, t_a)][-1] == "posted" and [a.status for a in _acks(snd, t_b)][-1] == "posted"
    assert {snd.state.status_of(t_a), snd.state.status_of(t_b)} == {"ok"}


def test_a_waiting_push_fails_when_ds_post_by_passes_and_a_cancel_ends_another_unposted():
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    _all_lanes_broken(snd, agents)
    _push(snd, "late", post_by_s=0.05)
    _push(snd, "gives-up")
    assert len(snd.writes.parked.waiting["d1"]) == 2
    time.sleep(0.1)
    snd.writes.expire()
    assert [a.status for a in _acks(snd, "late")][-1] == "failed" and snd.state.status_of("late") == "failed"
    assert [m.prefill.transfer_id for m, _ in snd.writes.parked.waiting["d1"]] == ["gives-up"]
    snd.flows.on_cancel(b"d1", "gives-up")
    last = _acks(snd, "gives-up")[-1]
    assert (last.status, last.posted) == ("cancelled", False) and not snd.writes.parked.waiting
    assert snd.take_finished() == {"req-late", "req-gives-up"}  # both pushes' blocks freed


def test_a_failed_write_does_not_tear_down_the_lane_reopened_under_its_index():
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    ls = LaneSet(hello("d1"), agents, 0, 5600, 2, entropy=NoEntropy())
    ls.open_all()
    snd.lanes.peers["d1"] = Peer(hello("d1"), b"d1", ls)
    for a in agents:
        a.stuck.add("d1")  # WRITEs to d1 stay in flight
    _push(snd, "t1")
    (f,) = snd.writes.in_flight.values()
    assert f.lane_obj is ls.lanes[f.lane]
    # the lane broke (another push failed on it) and was reopened under the same index
    ls.tear_down(f.lane)
    for a in agents:
        a.stuck.clear()
    list(ls.reopen_steps(f.lane))
    reopened = ls.lanes[f.lane]
    snd.writes.failed_write(f, "the old connection failed")  # UCX fails t1's WRITE on the old connection
    assert ls.lanes[f.lane] is reopened and not reopened.broken
    assert snd.state.status_of("t1") == "failed"
    # a WRITE that fails on the lane it was posted on tears that lane down
    for a in agents:
        a.stuck.add("d1")
    _push(snd, "t2")
    (g,) = snd.writes.in_flight.values()
    snd.writes.failed_write(g, "transfer error")
    assert ls.lanes[g.lane].broken


def test_the_set_up_queues_are_bounded(monkeypatch):
    from kvpath.connector import lane_setup

    monkeypatch.setattr(lane_setup, "MAX_QUEUED_SETUPS", 1)
    agents = [SlowAgent("a0", stuck={"d-a", "d-b", "d-c"}), SlowAgent("a1", stuck={"d-a", "d-b", "d-c"})]
    snd = writer(agents)
    snd.lanes.on_hello(b"d-a", hello("d-a"))  # running
    snd.lanes.on_hello(b"d-b", hello("d-b"))  # queued: the one place
    snd.lanes.on_hello(b"d-c", hello("d-c"))
    (w,) = welcomes(snd, b"d-c")
    assert not w.ok and w.field == "peers" and snd.stats.totals["peers_over_limit"] == 1
    # a D with no lane open whose reopen cannot be queued: its push fails at once, blocks freed
    ls = _all_lanes_broken(snd, [SlowAgent("b0"), SlowAgent("b1")], name="d1")
    snd.lanes.reopens[("other", 0)] = None  # the reopen queue is full
    _push(snd, "t1")
    assert not snd.writes.parked.waiting and [a.status for a in _acks(snd, "t1")][-1] == "failed"
    assert snd.take_finished() == {"req-t1"} and ls.lanes[0].broken


def test_a_push_whose_start_raises_when_d_registers_second_fails_cleanly():
    """Issue 32, finding 5: the registration that completes a match starts the push under
    the same guard as a finished prefill does: a raise fails that flow (D told, the
    blocks freed), it is never left matched with nothing posted."""
    agents = [SlowAgent("a0"), SlowAgent("a1")]
    snd = writer(agents)
    ls = LaneSet(hello("d1"), agents, 0, 5600, 2, entropy=NoEntropy())
    ls.open_all()
    snd.lanes.peers["d1"] = Peer(hello("d1"), b"d1", ls)
    freed = []
    snd.freed.release = lambda fp: freed.append(fp.request_id)

    def boom(m):
        raise RuntimeError("descriptor planning failed")

    snd.writes.start = boom
    _push(snd, "t7")  # the prefill first, then D's registration: the match happens on the Register
    assert [a.status for a in _acks(snd, "t7")] == ["accepted", "failed"]
    assert freed == ["req-t7"] and snd.state.idle() and snd.stats.totals["engine_thread_errors"] == 1
