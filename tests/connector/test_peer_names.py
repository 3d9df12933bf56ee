"""One spelling per P address (``PeerNames``) and a flow renamed to it (``ReceiverState.rename_peer``).
The end-to-end case (one P named two ways by one D, real NIXL): test_engine_nixl.py."""

import socket
import threading

import pytest
import zmq

from kvpath.connector import messages as M
from kvpath.connector.control_auth import ControlKeys
from kvpath.connector import peer_names
from kvpath.connector.peer_links import PeerLink
from kvpath.connector.peer_names import (FAIL_TTL_S, MAX_LOOKUPS, MAX_NAMES, MAX_UNRESOLVED, TTL_S, PeerNames,
                                         Unresolvable)
from kvpath.connector.recv_state import ReceiverState
from tests.connector.engine_doubles import FakeAgent, FakeDealer, bare_receiver
from tests.connector.nixl_sides import cfg
from tests.connector.state_doubles import Clock, rstate


class Resolver:
    """getaddrinfo's shape; ``table``: name -> addresses in the order a resolver gives them."""

    def __init__(self, table, gate=None):
        self.table, self.asked, self.gate = table, [], gate

    def __call__(self, host, port, type=0):
        if self.gate is not None:
            assert self.gate.wait(10)
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, 0)) for a in self.table[host]]


class Answers:
    """``on_answer``: counts the lookups that answered, and waits for them."""

    def __init__(self):
        self.n, self.cond = 0, threading.Condition()

    def __call__(self):
        with self.cond:
            self.n += 1
            self.cond.notify_all()

    def wait(self, n):
        with self.cond:
            assert self.cond.wait_for(lambda: self.n >= n, 10), f"{self.n} lookups answered, {n} expected"


def ask(names, answers, peer, n):
    """``canonical(peer)`` after the n-th answer (the first call starts the lookup)."""
    if names.canonical(peer) is None:
        answers.wait(n)
    return names.canonical(peer)


@pytest.mark.parametrize("given,one", [
    ("127.0.0.1:5600", "127.0.0.1:5600"),
    ("[::1]:5600", "[::1]:5600"),
    ("[0:0:0:0:0:0:0:1]:5600", "[::1]:5600"),
    ("[2001:DB8::0:1]:7", "[2001:db8::1]:7"),
])
def test_a_literal_address_has_one_spelling_without_a_lookup(given, one):
    res = Resolver({})
    assert PeerNames(res).canonical(given) == one
    assert res.asked == []


def test_a_name_is_its_address_ipv4_first_and_looked_up_again_after_its_ttl():
    clock, answers = Clock(), Answers()
    res = Resolver({"p0.pods": ["2001:db8::5", "10.0.0.7", "10.0.0.8"], "localhost": ["::1", "127.0.0.1"]})
    names = PeerNames(res, clock=clock, on_answer=answers)
    assert ask(names, answers, "P0.Pods.:5600", 1) == "10.0.0.7:5600"  # case and the root's dot do not matter
    assert names.canonical("p0.pods:5601") == "10.0.0.7:5601"
    assert ask(names, answers, "localhost:5600", 2) == "127.0.0.1:5600" == names.canonical("127.0.0.1:5600")
    assert res.asked == ["p0.pods", "localhost"]
    # after the TTL: the address in use is kept while the name is looked up again, and
    # kept after it while it is still among the answers (another order)
    clock.t += TTL_S + 1
    res.table["p0.pods"] = ["10.0.0.8", "10.0.0.7"]
    assert names.canonical("p0.pods:5600") == "10.0.0.7:5600"
    answers.wait(3)
    assert names.canonical("p0.pods:5600") == "10.0.0.7:5600"
    clock.t += TTL_S + 1  # P moved
    res.table["p0.pods"] = ["10.0.0.9"]
    assert names.canonical("p0.pods:5600") == "10.0.0.7:5600"
    answers.wait(4)
    assert names.canonical("p0.pods:5600") == "10.0.0.9:5600"
    # a failing resolver keeps the last address
    clock.t += TTL_S + 1
    del res.table["p0.pods"]
    assert names.canonical("p0.pods:5600") == "10.0.0.9:5600"
    answers.wait(5)
    assert names.canonical("p0.pods:5600") == "10.0.0.9:5600"


def test_a_name_that_does_not_resolve_fails_until_asked_again():
    clock, answers = Clock(), Answers()
    res = Resolver({})
    names = PeerNames(res, clock=clock, on_answer=answers)
    assert names.canonical("Nowhere:5600") is None  # looking
    answers.wait(1)
    with pytest.raises(Unresolvable, match="'nowhere' does not resolve"):
        names.canonical("nowhere:5600")
    assert res.asked == ["nowhere"]  # not asked again before FAIL_TTL_S
    clock.t += FAIL_TTL_S + 0.1
    res.table["nowhere"] = ["10.1.2.3"]
    assert ask(names, answers, "nowhere:5600", 2) == "10.1.2.3:5600"


def test_lookups_run_on_their_own_threads_a_few_at_once_and_names_are_bounded():
    gate, answers = threading.Event(), Answers()
    res = Resolver({f"h{i}": [f"10.0.{i // 250}.{i % 250}"] for i in range(MAX_NAMES + 10)}, gate=gate)
    names = PeerNames(res, clock=Clock(), on_answer=answers)
    # the resolver hangs: nobody waits on it, and no more than MAX_LOOKUPS run
    assert [names.canonical(f"h{i}:1") for i in range(MAX_LOOKUPS + 3)] == [None] * (MAX_LOOKUPS + 3)
    gate.set()
    answers.wait(MAX_LOOKUPS)
    assert sorted(res.asked) == sorted(f"h{i}" for i in range(MAX_LOOKUPS))  # the others waited for a slot
    for i in range(MAX_NAMES + 10):
        ask(names, answers, f"h{i}:1", answers.n + 1)
    assert names.cached() == MAX_NAMES
    asked = len(res.asked)
    assert names.canonical(f"h{MAX_NAMES + 9}:1") is not None  # the newest is kept
    n = answers.n
    assert names.canonical("h0:1") is None  # the oldest went: looked up again
    answers.wait(n + 1)
    assert len(res.asked) == asked + 1


def test_the_real_resolver_gives_localhost_its_loopback_address():
    answers = Answers()
    assert ask(PeerNames(on_answer=answers), answers, "localhost:5600", 1) == "127.0.0.1:5600"
    assert peer_names.literal("localhost") is None


def test_a_flow_renamed_to_its_address_is_found_by_it():
    r = ReceiverState(3.0, 10.0, 1.0, clock=Clock())
    serial = r.add("d1", "t1", ["localhost:5600", "localhost:5601"])
    assert serial and r.current("t1", "localhost:5600", serial)
    assert r.rename_peer("t1", "localhost:5600", "127.0.0.1:5600", serial)
    assert r.get("t1", "localhost:5600") is None
    assert r.get("t1", "127.0.0.1:5600").peer == "127.0.0.1:5600"
    assert r.on_sent("t1", "i1", peer="127.0.0.1:5600")
    assert r.rename_peer("t1", "127.0.0.1:5600", "127.0.0.1:5600", serial)  # nothing to do
    assert r.rename_peer("t9", "a:1", "b:1", serial)  # no such transfer: nothing to do
    # a stale command (another registration's serial) touches nothing
    assert r.rename_peer("t1", "localhost:5601", "127.0.0.2:5601", serial + 1)
    assert r.get("t1", "localhost:5601") is not None and not r.current("t1", "localhost:5601", serial + 1)
    # the request names one P twice: the second flow cannot take the first one's key
    assert not r.rename_peer("t1", "localhost:5601", "127.0.0.1:5600", serial)
    assert r.get("t1", "localhost:5601") is not None


def test_a_stale_command_never_sends_blocks_of_a_later_registration_of_the_same_ids(rx):
    """A registration parked for its lookup, cancelled (its blocks freed), then made again
    with the same request and transfer ids: only the second one's blocks go to P."""
    rcv, link, gate, answers = rx
    rcv.register("d1", "t1", "p0.pods:5600", [1, 2], 0)
    rcv.drain_commands()  # parked
    rcv.cancel("d1")
    assert rcv.state.take() == ({"d1"}, set())
    rcv.register("d1", "t1", "p0.pods:5600", [7, 8], 0)
    gate.set()
    answers.wait(1)
    rcv.drain_commands()
    assert [(m.transfer_id, m.block_ids) for m in link.sock.out] == [("t1", [7, 8])]


@pytest.fixture
def rx(nixl_keys):
    """D's receiver without its thread, keyed (any host may be named), one welcomed link
    to P at 10.0.0.7:5600; host names resolve through a gated fake."""
    c, conf = Clock(), cfg()
    rcv = bare_receiver(conf)
    rcv.state = rstate(c)
    rcv.agent = FakeAgent("d-agent")
    (p_key,) = ControlKeys.load(conf.control_key, conf.control_trusted_keys).trusted
    link = PeerLink("10.0.0.7:5600", FakeDealer(), welcomed=True, instance="pA", server_key=p_key)
    rcv.links.by_addr = {link.addr: link}
    gate, answers = threading.Event(), Answers()
    wake = rcv.links.names.on_answer  # the receiver's: retry what waits for a lookup

    def on_answer():
        wake()
        answers()

    rcv.links.names = PeerNames(Resolver({"p0.pods": ["10.0.0.7"]}, gate=gate), clock=c, on_answer=on_answer)
    return rcv, link, gate, answers


def test_a_registration_waits_unsent_for_its_lookup_then_goes_to_the_address(rx):
    rcv, link, gate, answers = rx
    rcv.register("d1", "t1", "p0.pods:5600", [1], 0)
    rcv.register("d2", "t2", "p0.pods:5600", [2], 0)
    rcv.drain_commands()
    assert link.sock.out == [] and rcv.state.get("t1", "p0.pods:5600").sent is False
    rcv.cancel("d2")  # ends while it waits: released at once (never sent), never sent later
    assert rcv.state.take() == ({"d2"}, set())
    gate.set()
    answers.wait(1)
    rcv.drain_commands()
    assert [(type(m), m.transfer_id) for m in link.sock.out] == [(M.Register, "t1")]
    w = rcv.state.get("t1", "10.0.0.7:5600")
    assert w is not None and w.sent  # P's answers, which come on this link, find it
    rcv.drain_commands()
    assert len(link.sock.out) == 1  # nothing parked is left


def test_a_registration_naming_a_host_that_does_not_resolve_fails_at_once(rx):
    rcv, link, gate, answers = rx
    gate.set()
    rcv.register("d1", "t1", "nowhere.pods:5600", [1], 0)
    rcv.drain_commands()
    answers.wait(1)
    rcv.drain_commands()
    assert rcv.state.take() == ({"d1"}, {"d1"}) and link.sock.out == []



def test_one_p_process_at_two_addresses_is_counted_named_and_its_idle_link_closed(nixl_keys, caplog):
    """Two addresses of one P (two interfaces, 127.0.0.1 and 127.0.0.2) cannot be told
    apart by their spelling: P's handshake names its process, and D says what it sees and
    closes the older link when nothing waits on it (their tug of war over the id ends)."""
    conf = cfg()
    rcv = bare_receiver(conf)
    rcv.links.poller = zmq.Poller()
    (key,) = ControlKeys.load(conf.control_key, conf.control_trusted_keys).trusted

    def welcomed(addr, instance):
        link = rcv.links.link(addr, key)
        rcv.on_welcome(link, M.Welcome(instance, True, complete=True))
        return link

    welcomed("10.0.0.7:5600", "pA")
    welcomed("10.0.9.9:5600", "pB")  # another process: nothing to say
    assert rcv.stats.snapshot()["peers_aliased"] == 0
    welcomed("10.0.1.7:5600", "pA")
    assert rcv.stats.snapshot()["peers_aliased"] == 1
    assert "10.0.1.7:5600 is the process D also reaches at 10.0.0.7:5600" in caplog.text
    assert "10.0.0.7:5600" not in rcv.links and "10.0.1.7:5600" in rcv.links  # the idle one went
    # a link something waits on is kept (its requests' fence needs it)
    welcomed("10.0.2.7:5600", "pC")
    assert rcv.state.add("d9", "t9", "10.0.2.7:5600")
    welcomed("10.0.3.7:5600", "pC")
    assert rcv.stats.snapshot()["peers_aliased"] == 2
    assert "10.0.2.7:5600" in rcv.links and "Requests waiting on 10.0.2.7:5600 may not arrive" in caplog.text


def test_of_a_names_addresses_one_a_link_goes_to_is_taken():
    answers = Answers()
    res = Resolver({"p0.pods": ["10.0.0.7", "10.0.0.8"]})
    names = PeerNames(res, clock=Clock(), on_answer=answers, linked=lambda addr: addr == "10.0.0.8")
    assert ask(names, answers, "p0.pods:5600", 1) == "10.0.0.8:5600"


def test_names_a_peer_makes_up_leave_before_names_in_use():
    answers = Answers()
    res = Resolver({f"h{i}": [f"10.0.{i // 250}.{i % 250}"] for i in range(MAX_NAMES)})
    names = PeerNames(res, clock=Clock(), on_answer=answers)
    for i in range(MAX_NAMES):
        ask(names, answers, f"h{i}:1", i + 1)
    for j in range(MAX_UNRESOLVED + 10):  # names that never resolve
        n = answers.n
        if names.canonical(f"junk{j}:1") is None:
            answers.wait(n + 1)
    assert names.cached() == MAX_NAMES + MAX_UNRESOLVED
    asked = len(res.asked)
    assert [names.canonical(f"h{i}:1") for i in (0, MAX_NAMES - 1)] == ["10.0.0.0:1", f"10.0.4.{(MAX_NAMES - 1) % 250}:1"]
    assert len(res.asked) == asked  # still known: no lookup


def test_no_thread_for_a_lookup_fails_the_name_for_a_while_and_frees_its_slot(monkeypatch):
    clock, answers = Clock(), Answers()
    names = PeerNames(Resolver({"p0.pods": ["10.0.0.7"]}), clock=clock, on_answer=answers)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_thread)
        for _ in range(MAX_LOOKUPS + 1):
            with pytest.raises(Unresolvable, match="no thread for the lookup"):
                names.canonical("p0.pods:5600")
    clock.t += FAIL_TTL_S + 0.1
    assert ask(names, answers, "p0.pods:5600", 1) == "10.0.0.7:5600"


def test_a_registration_whose_deadline_passed_while_its_lookup_ran_is_never_sent(rx):
    rcv, link, gate, answers = rx
    rcv.register("d1", "t1", "p0.pods:5600", [1], 0)
    rcv.drain_commands()  # parked
    rcv.state.clock.t += 60  # past its liveness and max wait: given up unsent, released as failed
    rcv.state.expire(lambda peer, instance: None)
    assert rcv.state.take() == ({"d1"}, {"d1"})
    gate.set()
    answers.wait(1)
    rcv.drain_commands()
    assert link.sock.out == []
