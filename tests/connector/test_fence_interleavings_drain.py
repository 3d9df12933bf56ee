"""The fence's drain check under hostile interleavings: D frees blocks P's lanes may
still write into only once those connections are closed and read, never when it cannot
tell (lanes unknown, an unannounced connection, a Welcome that cannot list every lane,
P named by host name): then the time bound decides, and known lanes never drained hold
past it. The fence's other interleavings: test_fence_interleavings.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import types

import pytest

from kvpath.connector import messages as M
from kvpath.connector.peer_links import PeerLink
from kvpath.connector.tcp_table import lanes_drained
from tests.connector.engine_doubles import FakeDealer
from tests.connector.state_doubles import Clock, never_drained, receiver, rstate, sender, sent


def unknown_lanes(peer: str, instance: str) -> bool | None:
    return None  # D does not know P's lane connections


# -- the drain check with unknown lanes -------------------------------------------
@pytest.fixture
def established():
    """A listening port with one established connection into it from 127.0.0.1."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    yield srv.getsockname()[1], cli
    for s in (cli, conn, srv):
        s.close()


def test_drain_check_never_passes_without_known_lanes(established):
    port, cli = established
    assert lanes_drained({port}, set()) is None  # cannot tell: never "drained"
    assert lanes_drained({port}, {cli.getsockname()}) is False  # known and established


@pytest.fixture
def from_another_process():
    """A listening port here with an established connection into it from another
    process (as P's lane is): yields (port, the connection's remote address, our end,
    the other process)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\n"
                             f"s = socket.create_connection(('127.0.0.1', {port}))\n"
                             "sys.stdin.read()\n"], stdin=subprocess.PIPE)
    conn, remote = srv.accept()
    yield port, remote, conn, proc
    proc.kill()
    proc.wait()
    conn.close()
    srv.close()


def test_an_open_connection_nobody_announced_keeps_the_drain_check_from_passing(from_another_process):
    """Issue 32, finding 2: P's announced lane is gone (closed and reaped), but an
    established connection into D's UCX port that no Welcome named (a reopened lane
    whose Welcome was lost, or P behind NAT) may be P's: the check says "cannot tell"
    (the time bound decides), never "drained"."""
    port, remote, conn, proc = from_another_process
    gone = {("127.0.0.1", 1)}  # the lane P announced: no socket any more
    assert lanes_drained({port}, gone, announced=gone) is None
    # the same connection announced by another P process: it is not this P's
    assert lanes_drained({port}, gone, announced=gone | {remote}) is True
    # once it is closed and read (to its end: the FIN counts as unread), nothing can deliver
    proc.kill()
    proc.wait()
    assert conn.recv(16) == b""
    deadline = time.monotonic() + 5
    while lanes_drained({port}, gone, announced=gone) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lanes_drained({port}, gone, announced=gone) is True


def test_a_welcome_that_cannot_list_every_lane_leaves_that_p_to_the_bound(from_another_process):
    port, remote, _, _ = from_another_process
    rcv, link = receiver(Clock())
    rcv.listen_ports = [port]
    rcv.links.by_addr = {"h:1": link}
    rcv.on_welcome(link, M.Welcome("pA", True, lanes=[("10.9.9.9", 4000)], agents=["a"], complete=False))
    assert rcv.drained("h:1", "pA") is None
    rcv.on_welcome(link, M.Welcome("pA", True, lanes=[("10.9.9.9", 4001)], agents=["a"], complete=True))
    assert rcv.drained("h:1", "pA") is None  # sticky: the unlisted lane may still be open
    link.incomplete.clear()  # (a complete view of this P: only its own lanes count)
    assert rcv.drained("h:1", "pA") is None  # our established one is announced by nobody
    link.lanes["pOld"] = {remote}  # announced by a process of that P that is gone: says nothing
    assert rcv.drained("h:1", "pA") is None
    other = PeerLink("h:2", FakeDealer(), welcomed=True, instance="pB")
    rcv.links.by_addr["h:2"] = other
    rcv.on_welcome(other, M.Welcome("pB", True, lanes=[remote], agents=["b"], complete=True))
    assert rcv.drained("h:1", "pA") is True  # a live P's announced lane is that P's


def test_p_says_its_welcome_is_incomplete_when_a_lanes_5_tuple_is_unknown():
    snd = sender("pA")

    class Lanes:
        def __init__(self, ports):
            self.lanes = [types.SimpleNamespace(src_ip="10.0.0.1", src_port=p) for p in ports]

        def agent(self, i):
            return types.SimpleNamespace(name=f"a{i}")

    snd.lanes.welcome(types.SimpleNamespace(ident=b"d1", lanes=Lanes([4000, 4001])))
    snd.lanes.welcome(types.SimpleNamespace(ident=b"d1", lanes=Lanes([4000, 0])))
    out = [msg for _, msg in snd.channel.router.out]
    assert [(w.complete, w.lanes) for w in out] == [(True, [("10.0.0.1", 4000), ("10.0.0.1", 4001)]),
                                                     (False, [("10.0.0.1", 4000)])]


def test_receiver_drain_with_a_hostname_peer_and_no_lanes_is_unknown(established):
    """P named by host name: the old check compared it with the sockets' IPs, found no
    match and said "drained" while P's connection was established."""
    port, _ = established
    rcv, link = receiver(Clock())
    rcv.listen_ports = [port]
    rcv.links.by_addr = {"localhost:5600": PeerLink("localhost:5600", FakeDealer(), instance="pA")}
    assert rcv.drained("localhost:5600", "pA") is None


def test_unknown_lanes_release_only_after_the_bound():
    c = Clock()
    r = rstate(c, live=3.0, wait=10.0, grace=1.0, bound=5.0)
    sent(r, "d1", "t1")
    c.t = 3.0
    r.expire(unknown_lanes)  # P silent: gave up
    for t in (3.0, 10.0, 15.99):
        c.t = t
        assert r.expire(unknown_lanes)[1] == []
    c.t = 16.0  # sent + max_wait_s (P's post_by) + write_bound_s + grace_s
    released = r.expire(unknown_lanes)[1]
    assert [w.request_id for w in released] == ["d1"] and released[0].released_by == "bound"
    assert r.take() == ({"d1"}, {"d1"})


def test_known_lanes_never_drained_hold_past_the_bound():
    c = Clock()
    r = rstate(c)
    sent(r, "d1", "t1")
    for t in (3.0, 16.0, 1000.0):
        c.t = t
        r.expire(never_drained)
    assert r.take() == (set(), set())  # a live P's lanes: its answer or its death decides

def test_a_connection_of_this_process_to_itself_is_not_a_peers():
    """UCX connects D's worker to itself: both ends are this process's sockets, so it
    is not a lane of any P and does not keep the drain check from passing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    gone = {("127.0.0.2", 1)}
    assert lanes_drained({port}, gone, announced=gone) is True
    for s in (cli, conn, srv):
        s.close()
