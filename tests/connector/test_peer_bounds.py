"""What peers leave behind on P is bounded: lanes that fail to open release their NIXL
remote agents, candidate lanes not taken release theirs, and D workers that hold
nothing and were silent for peer_idle_timeout_s are forgotten (or make room)."""

import time

import pytest

from kvpath.connector import lane_setup
from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.lane_setup import Peer
from kvpath.connector.lanes import LaneSet
from kvpath.connector.layout import BlockLayout, Region
from kvpath.connector.push_state import FinishedPrefill, PendingRegistration
from kvpath.connector.sender import PushSender
from tests.connector.engine_doubles import bare_sender

LAY = BlockLayout([Region(base=4096, block_len=64, block_stride=64)], num_blocks=8, block_size=16)


class FakeNixlAgent:
    """The NIXL calls LaneSet makes; ``fail_probe``: the probe WRITE ends in ERR."""

    def __init__(self, name: str, fail_probe: bool = False):
        self.name, self.fail_probe = name, fail_probe
        self.remote: set[str] = set()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remote.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.remote.discard(name)

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, loc, rem, remote, notif=b""):
        return object()

    def transfer(self, handle) -> str:
        return "ERR" if self.fail_probe else "DONE"

    def check_xfer_state(self, handle) -> str:
        return self.transfer(handle)

    def release_xfer_handle(self, handle) -> None:
        pass


class NoEntropy:
    def snapshot(self):
        return set()

    def learn(self, before, peer_ports, own_port):
        return []


def hello(name: str = "d-agent") -> M.Hello:
    return M.Hello(engine_id="d", agent_name=name, agent_metadata=name.encode(), layout=LAY, compat=M.Compat(),
                   instance="i", heartbeat_s=1.0, probe_addr=8192, probe_len=8)


def test_a_lane_whose_probe_fails_leaves_no_remote_agent():
    agents = [FakeNixlAgent("a0"), FakeNixlAgent("a1", fail_probe=True)]
    ls = LaneSet(hello(), agents, probe_addr=4096, own_port=1, n_lanes=2, entropy=NoEntropy())
    with pytest.raises(RuntimeError, match="probe"):
        ls.open_all()
    assert agents[1].remote == set()  # the failed lane's agent
    for i in range(2):  # what the writer does after a failed set-up
        ls.tear_down(i)
    assert all(a.remote == set() for a in agents)


def test_path_candidates_release_their_agents_when_not_taken_or_when_set_up_fails():
    agents = [FakeNixlAgent(f"a{i}") for i in range(4)]
    ls = LaneSet(hello(), agents, probe_addr=4096, own_port=1, n_lanes=2, path_of=lambda lane: "s0", n_paths=2,
                 entropy=NoEntropy())
    ls.open_all()  # all four candidates take spine s0: two are taken, the others let go
    taken = {ls.lanes[i].agent for i in range(2)}
    assert [bool(a.remote) for a in agents] == [i in taken for i in range(4)]
    agents = [FakeNixlAgent("a0"), FakeNixlAgent("a1"), FakeNixlAgent("a2", fail_probe=True)]
    ls = LaneSet(hello(), agents, probe_addr=4096, own_port=1, n_lanes=2, path_of=lambda lane: "s0", n_paths=2,
                 entropy=NoEntropy())
    with pytest.raises(RuntimeError):
        ls.open_all()
    assert all(a.remote == set() for a in agents)


class FakeLanes:
    def __init__(self):
        self.lanes = [object(), object()]
        self.torn = []

    def tear_down(self, i):
        self.torn.append(i)


def writer(timeout_s: float = 600.0, engine_id: str | None = None, **knobs) -> PushSender:
    return bare_sender(KVPathConfig(control_plaintext=True, peer_idle_timeout_s=timeout_s, **knobs), LAY,
                       engine_id=engine_id)


def add_peer(snd: PushSender, name: str, last_seen: float) -> Peer:
    p = snd.lanes.peers[name] = Peer(hello(name), name.encode(), FakeLanes(), last_seen=last_seen)
    return p


def test_idle_silent_peers_are_forgotten_and_their_lanes_released_busy_ones_kept():
    snd = writer(timeout_s=60.0)
    now = time.monotonic()
    old = add_peer(snd, "gone", now - 120)
    add_peer(snd, "recent", now - 5)
    add_peer(snd, "busy", now - 120)
    snd.state.registrations["t"] = PendingRegistration(M.Register("t", "r", "busy", [1]), b"busy", post_by=now + 60)
    snd.lanes.prune(now)
    assert set(snd.lanes.peers) == {"recent", "busy"}
    assert old.lanes.torn == [0, 1] and snd.stats.totals["peers_forgotten"] == 1


def test_a_full_table_makes_room_with_the_least_recently_seen_idle_peer(monkeypatch):
    monkeypatch.setattr(lane_setup, "MAX_PEERS", 2)
    snd = writer()
    now = time.monotonic()
    add_peer(snd, "older", now - 30)
    add_peer(snd, "newer", now - 10)
    snd.lanes.prune(now, need_room=True)
    assert set(snd.lanes.peers) == {"newer"}


class RecordingNotifier:
    def __init__(self):
        self.calls = []

    def register_lanes(self, src, dst, lanes, worker="", pair=None):
        self.calls.append(("register", src, dst, lanes, pair))

    def unregister_lanes(self, src, dst, worker="", pair=None):
        self.calls.append(("unregister", src, dst, None, pair))


def test_a_forgotten_d_unregisters_its_own_incarnation_only_a_restarted_d_keeps_its_lanes():
    from kvpath.fabric import FabricSpec
    from kvpath.reservation.decisions import LaneInfo, ReservationService

    snd = writer(timeout_s=60.0, engine_id="p-l0h0", fabric_host="l0h0")
    snd.lanes.notifier = RecordingNotifier()
    now = time.monotonic()
    old = Peer(M.Hello(engine_id="d-l1h0", agent_name="d-old", agent_metadata=b"x", layout=LAY, compat=M.Compat(),
                       instance="i", heartbeat_s=1.0, fabric_host="l1h0"), b"d-old", FakeLanes(), last_seen=now - 120)
    snd.lanes.peers["d-old"] = old
    snd.lanes.prune(now)  # silent for 120 s: forgotten, after its D restarted as "d-new"
    (kind, src, dst, _, pair), = snd.lanes.notifier.calls
    assert (kind, src, dst) == ("unregister", "l0h0", "l1h0")
    assert pair.key() == "p-l0h0/r0>d-l1h0/r0" and pair.incarnation == "pA>d-old"  # P's process and D's
    # on the service, the new incarnation registered meanwhile keeps its lanes
    svc = ReservationService(FabricSpec(leaves=2, spines=4, hosts_per_leaf=2), "cc")
    svc.register_lanes("l0h0", "l1h0", [LaneInfo(0, 40000)], pair=msgspec_replace(pair, incarnation="pA>d-new"))
    assert svc.unregister_lanes(src, dst, pair=pair) == 0
    assert svc.lanes("l0h0", "l1h0", pair=pair) == [LaneInfo(0, 40000)]


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


# -- D: control links --------------------------------------------------------------


class _Named:
    name = "d-agent-x"


@pytest.fixture
def receiver():
    import numpy as np
    import zmq

    from kvpath.connector.layout import layout_from_buffers
    from kvpath.connector.receiver import PushReceiver

    buf = np.zeros(16 * 1024, dtype=np.uint8)
    spans = [(buf.ctypes.data, buf.nbytes)]
    r = PushReceiver(KVPathConfig(control_plaintext=True, peer_idle_timeout_s=60.0), layout_from_buffers(spans, 16, 16),
                     spans)
    r.links.agent_name = _Named.name
    r.links.poller = zmq.Poller()
    yield r
    r.close()


def test_idle_links_are_dropped_busy_ones_kept_and_a_new_link_keeps_the_routing_id(receiver):
    r = receiver
    idle, busy = r.links.link("127.0.0.1:1", None), r.links.link("127.0.0.1:2", None)
    assert idle.sock.routing_id == busy.sock.routing_id  # one id per process: P knows us again by it
    rid = idle.sock.routing_id
    idle.welcomed = busy.welcomed = True
    idle.used_at = busy.used_at = time.monotonic() - 120
    r.state.add("req", "t1", "127.0.0.1:2")  # a request waits on P 2
    r.links.prune(time.monotonic())
    assert set(r.links.by_addr) == {"127.0.0.1:2"} and r.stats.totals["peers_forgotten"] == 1
    assert r.links.link("127.0.0.1:1", None).sock.routing_id == rid


def test_an_unanswered_hello_link_is_dropped_after_two_heartbeats(receiver):
    r = receiver
    link = r.links.link("127.0.0.1:1", None)
    link.hello_at = time.monotonic() - 3 * r.cfg.heartbeat_s()
    r.links.prune(time.monotonic())
    assert r.links.by_addr == {}


def test_past_the_link_limit_a_new_peer_gets_none_unless_an_idle_link_makes_room(receiver, monkeypatch):
    from kvpath.connector import peer_links

    monkeypatch.setattr(peer_links, "MAX_LINKS", 1)
    r = receiver
    first = r.links.link("127.0.0.1:1", None)
    first.welcomed = True
    r.state.add("req", "t1", "127.0.0.1:1")
    assert r.links.link("127.0.0.1:2", None) is None  # the only link is busy
    r.state.by_tid.clear()
    assert r.links.link("127.0.0.1:2", None) is not None and set(r.links.by_addr) == {"127.0.0.1:2"}


def test_p_registers_each_ds_lanes_again_every_minute_and_skips_engine_ids_the_service_refuses(monkeypatch):
    snd = writer(engine_id="p-l0h0", fabric_host="l0h0")
    snd.lanes.notifier = RecordingNotifier()

    class Lanes:
        lanes = []

    def d(name, engine):
        return Peer(M.Hello(engine_id=engine, agent_name=name, agent_metadata=b"x", layout=LAY, compat=M.Compat(),
                            instance="i", heartbeat_s=1.0, fabric_host="l1h0"), name.encode(), Lanes())

    snd.lanes.peers = {"d1": d("d1", "d-l1h0"), "bad": d("bad", "d/evil"), "twin": d("twin", "d-l1h0")}
    t = [1000.0]
    monkeypatch.setattr(lane_setup.time, "monotonic", lambda: t[0])
    snd.lanes.refresh_registrations(t[0])
    registered = [c[4].incarnation for c in snd.lanes.notifier.calls if c[0] == "register"]
    assert registered == ["pA>d1", "pA>twin"]  # "d/evil" would make the pair's name ambiguous: skipped
    assert snd.stats.totals["lane_registrations_skipped"] == 1
    assert snd.stats.totals["worker_pair_collisions"] == 2  # each of the two D workers is named
    t[0] += 30
    snd.lanes.refresh_registrations(t[0])
    assert len(snd.lanes.notifier.calls) == 2  # not yet
    t[0] += 31
    snd.lanes.refresh_registrations(t[0])
    assert len([c for c in snd.lanes.notifier.calls if c[0] == "register"]) == 4  # both again, a minute later
    assert snd.stats.totals["lane_registrations_skipped"] == 1  # warned once


def test_waiting_registrations_are_bounded_per_d_worker_by_count_and_blocks_and_in_total(monkeypatch):
    """Issue 32, finding 4: a D worker (any holder of the pool's key) cannot make P hold
    registrations without end: past its count, past its own number of blocks, or past
    P's total, a Register is refused by name and counted."""
    from kvpath.connector import flow_matching
    from tests.connector.test_lane_setup_steps import writer as steps_writer

    monkeypatch.setattr(flow_matching, "MAX_WAITING_PER_PEER", 3)
    monkeypatch.setattr(flow_matching, "MAX_WAITING_REGISTRATIONS", 5)
    snd = steps_writer([FakeNixlAgent("a0"), FakeNixlAgent("a1")])
    for name in ("d1", "d2", "d3"):
        ls = LaneSet(hello(name), snd.lanes.agents, 0, 5600, 2, entropy=NoEntropy())
        ls.open_all()
        snd.lanes.peers[name] = Peer(hello(name), name.encode(), ls)

    def register(name, tid, blocks):
        snd.flows.on_register(name.encode(), M.Register(tid, "r-" + tid, name, list(blocks), sent_at=time.time()))
        return [m for i, m in snd.channel.router.out if isinstance(m, M.Ack) and m.transfer_id == tid][-1]

    assert [register("d1", f"a{i}", [i]).status for i in range(3)] == ["accepted"] * 3
    over = register("d1", "a3", [3])
    assert over.status == "rejected" and "registrations" in over.detail and "at most 3" in over.detail
    # blocks: LAY has 8; d2 holds 6 waiting, 3 more would be 9
    assert register("d2", "b0", range(6)).status == "accepted"
    over = register("d2", "b1", [0, 1, 2])
    assert over.status == "rejected" and over.detail.startswith("block_ids") and "8" in over.detail
    assert register("d3", "c0", [0]).status == "accepted"
    over = register("d3", "c1", [1])  # 5 wait in total: P's bound
    assert over.status == "rejected" and "over all D workers" in over.detail
    assert snd.stats.totals["registrations_over_limit"] == 3
    # a registration that matched its prefill no longer counts: room again
    snd.state.add_prefill(FinishedPrefill("p-a0", "a0", [1]))
    assert snd.state.waiting_of(b"d1") == (2, 2) and len(snd.state.registrations) == 4
    assert register("d3", "c2", [1]).status == "accepted"
