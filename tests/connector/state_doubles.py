"""A fake clock, and what the fence tests build on it: D's ``ReceiverState``, and the
engine threads without their thread, sockets or NIXL (over engine_doubles.py's fakes),
D welcomed by P process ``pA`` at ``PEER``."""

from __future__ import annotations

from kvpath.connector.peer_links import PeerLink
from kvpath.connector.receiver import PushReceiver
from kvpath.connector.recv_state import ReceiverState
from kvpath.connector.sender import PushSender
from tests.connector.engine_doubles import FakeDealer, bare_receiver, bare_sender

PEER = "h:1"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rstate(c: Clock, live: float = 3.0, wait: float = 10.0, grace: float = 1.0, bound: float = 5.0) -> ReceiverState:
    return ReceiverState(live, wait, grace, clock=c, write_bound_s=bound)


def sent(r: ReceiverState, rid: str, tid: str, instance: str = "pA") -> None:
    assert r.add(rid, tid, PEER)
    assert r.on_sent(tid, instance)


def never_drained(peer: str, instance: str) -> bool | None:
    return False  # P's lanes are known and still established


def receiver(c: Clock, **kw) -> tuple[PushReceiver, PeerLink]:
    """A PushReceiver without its thread or NIXL agent, welcomed by P ``pA``."""
    rcv = bare_receiver()
    rcv.state = rstate(c, **kw)
    link = PeerLink(PEER, FakeDealer(), welcomed=True, instance="pA")
    link.agents["pA"] = {"pA-lane0"}
    rcv.links.by_addr = {PEER: link}
    return rcv, link


def sender(instance: str) -> PushSender:
    """A PushSender (P's writer) without its thread, sockets or NIXL agents."""
    snd = bare_sender(instance=instance)
    snd.state.lease_s = 30.0
    return snd
