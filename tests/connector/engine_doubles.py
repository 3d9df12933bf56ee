"""Fakes of the engine threads' I/O (the ZMQ sockets, the NIXL agent) and the engine
threads built around them without starting: a test drives one part of the writer or
the receiver, one call at a time, and reads what went out."""

from __future__ import annotations


import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.receiver import PushReceiver
from kvpath.connector.sender import PushSender

LAY = M.BlockLayout([M.Region(4096, 64, 64)], 16, 16)

_made: list = []  # engine threads built here; closed by the conftest after each test


class FakeDealer:
    """D's DEALER socket: records what was queued; ``on_send`` runs inside send()."""

    def __init__(self, on_send=None, full: bool = False) -> None:
        self.out: list = []
        self.on_send = on_send
        self.full = full

    def send(self, data: bytes, flags: int = 0) -> None:
        if self.on_send is not None:
            self.on_send()
        if self.full:
            raise zmq.Again()
        self.out.append(M.decode_to_prefill(data))


class FakeRouter:
    """P's ROUTER socket: records (identity, message)."""

    def __init__(self) -> None:
        self.out: list = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.out.append((frames[0], M.decode_to_decode(frames[1])))


class FakeAgent:
    def __init__(self, name: str, notifs: dict[str, list[bytes]] | None = None) -> None:
        self.name = name
        self.notifs = notifs or {}

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.notifs = self.notifs, {}
        return out


def bare_sender(cfg: KVPathConfig | None = None, layout: M.BlockLayout = LAY, agents: list | None = None,
                instance: str = "pA", compat: M.Compat | None = None, engine_id: str | None = None) -> PushSender:
    """A PushSender (P's writer) not started: no thread, no bound socket, no NIXL agent;
    its control channel sends into a :class:`FakeRouter` (``snd.channel.router.out``)."""
    snd = PushSender(cfg or KVPathConfig(control_plaintext=True), layout, spans=[], compat=compat or M.Compat(),
                     engine_id=engine_id)
    snd.channel.router = FakeRouter()
    snd.channel.instance = instance
    snd.lanes.agents = list(agents or [])
    _made.append(snd)
    return snd


def bare_receiver(cfg: KVPathConfig | None = None, layout: M.BlockLayout = LAY) -> PushReceiver:
    """A PushReceiver (D's receiver) not started: no thread, no NIXL agent; the test
    gives it links (``rcv.links.by_addr``) over :class:`FakeDealer` sockets."""
    rcv = PushReceiver(cfg or KVPathConfig(control_plaintext=True), layout, spans=[])
    _made.append(rcv)
    return rcv


def close_made() -> None:
    while _made:
        _made.pop().close()  # a second close (the test closed it) is harmless
