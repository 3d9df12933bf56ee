"""Lanes from one P worker to one D worker: open, learn each one's 5-tuple, pick
them to cover distinct paths, tear down.

A lane is one NIXL agent of P's with its own UCX TCP connection to D, so its own
source port and its own ECMP path. Lanes open on the first contact (the handshake)
and are kept. With a path oracle, P tries candidate connections (one per agent of
a larger pool) until its lanes cover distinct paths: as many as the fabric has
between the two hosts, up to ``lanes``. Four random ports cover four spines only
about 9% of the time (4!/4^4); 16 candidates cover them about 96% of the time.
A lane whose WRITE failed is torn down (its remote agent removed) and reopened on
its next use.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Hashable, TypeVar

import numpy as np

from kvpath.connector import messages as M
from kvpath.connector.config import is_wildcard
from kvpath.connector.entropy import PathEntropyProvider, TcpSocketEntropy
from kvpath.five_tuple import FiveTuple

logger = logging.getLogger(__name__)

T = TypeVar("T")
PROBE_TIMEOUT_S = 5.0  # a lane whose 8-byte probe WRITE has not completed by then failed to open


@dataclass
class Lane:
    lane_id: int
    src_ip: str = ""
    src_port: int = 0  # 0: not learned (the peer's connection could not be told apart)
    dst_ip: str = ""
    dst_port: int = 0
    broken: bool = False
    agent: int = 0  # index in the writer's agent pool
    path: str = ""  # what the path oracle said ("" without one)

    def five_tuple(self) -> FiveTuple | None:
        """None until the lane's connection is learned."""
        if not (self.src_port and self.src_ip and self.dst_ip):
            return None
        return FiveTuple(self.src_ip, self.dst_ip, self.src_port, self.dst_port, "tcp")


def pick_distinct_steps(pool: int, want: int, distinct: int) -> Generator[int, Hashable, list[int]]:
    """Choose ``want`` candidates out of ``pool``, opening them in order (this yields
    the index of the next one to open and is sent its path), until ``distinct``
    different paths are covered; the remaining lanes are filled with the first
    duplicates. Returns the chosen candidate indices, lane order."""
    chosen: list[int] = []
    dupes: list[int] = []
    seen: set[Hashable] = set()
    i = 0
    while i < pool and len(chosen) < want and len(seen) < distinct:
        key = yield i
        (dupes if key in seen else chosen).append(i)
        seen.add(key)
        i += 1
    while len(chosen) < want and dupes:
        chosen.append(dupes.pop(0))
    while len(chosen) < want and i < pool:  # all paths covered: take the next ones as they come
        yield i
        chosen.append(i)
        i += 1
    return chosen


def pick_distinct(open_candidate: Callable[[int], Hashable], pool: int, want: int, distinct: int) -> list[int]:
    """:func:`pick_distinct_steps` with ``open_candidate(i)`` returning candidate i's path."""
    steps = pick_distinct_steps(pool, want, distinct)
    try:
        i = next(steps)
        while True:
            i = steps.send(open_candidate(i))
    except StopIteration as done:
        return done.value


def drive(steps: Generator[None, None, T]) -> T:
    """Run a set-up generator to its end here, progressing its probes (blocking)."""
    try:
        while True:
            next(steps)
            time.sleep(0.0002)
    except StopIteration as done:
        return done.value


class LaneSet:
    """The lanes of one (P worker, D worker) pair. Writer thread only."""

    def __init__(
        self, hello: M.Hello, agents: list[Any], probe_addr: int, own_port: int, n_lanes: int | None = None,
        path_of: Callable[[Lane], str] | None = None, n_paths: int = 1,
        entropy: PathEntropyProvider | None = None,
    ):
        self.hello = hello
        self.agents = agents  # the writer's pool, shared by all peers
        self.probe_addr = probe_addr
        self.own_port = own_port
        self.n_lanes = n_lanes or len(agents)
        self.path_of = path_of
        self.n_paths = n_paths
        self.entropy = entropy or TcpSocketEntropy()
        self.lanes: list[Lane] = [Lane(i, broken=True, agent=i) for i in range(self.n_lanes)]
        self.candidates_opened = 0

    def open_all(self) -> None:
        """Open every lane here, blocking (each probe up to PROBE_TIMEOUT_S)."""
        drive(self.open_steps())

    def open_steps(self) -> Generator[None, None, None]:
        """Open every lane, one probe at a time: yields while a probe is in flight (the
        writer's loop steps it between its other work), raises when a lane cannot
        open. What a failed set-up created is released before it raises."""
        yield from self.reachable_steps()
        if self.path_of is None:
            for i in range(self.n_lanes):
                self.lanes[i] = yield from self._connect_steps(self.lanes[i].agent, i)
            return
        opened: dict[int, Lane] = {}
        picker = pick_distinct_steps(len(self.agents), self.n_lanes, min(self.n_lanes, self.n_paths))
        try:
            a = next(picker)
            while True:
                opened[a] = yield from self._connect_steps(a, a)
                a = picker.send(opened[a].path)
        except StopIteration as done:
            chosen = done.value
        except BaseException:  # GeneratorExit too: a set-up abandoned leaves nothing behind
            for a in opened:
                self._remove_remote(a)
            raise
        self.candidates_opened = len(opened)
        for lane_id, a in enumerate(chosen):
            lane = opened[a]
            lane.lane_id = lane_id
            self.lanes[lane_id] = lane
        for a in set(opened) - set(chosen):  # candidates not taken: nothing of D's stays on them
            self._remove_remote(a)

    def abandon(self) -> None:
        """Remove D's remote agent from every pool agent (a set-up that will not finish)."""
        for a in range(len(self.agents)):
            self._remove_remote(a, quiet=True)

    def _remove_remote(self, a: int, quiet: bool = False) -> None:
        try:
            self.agents[a].remove_remote_agent(self.hello.agent_name)
        except Exception:
            if not quiet:
                logger.warning("removing %s from agent %d failed", self.hello.agent_name, a, exc_info=True)

    def agent(self, i: int) -> Any:
        return self.agents[self.lanes[i].agent]

    def reopen_steps(self, i: int) -> Generator[None, None, None]:
        """Reopen broken lane ``i`` on the writer's loop (one probe poll per step)."""
        yield from self.reachable_steps()
        self.lanes[i] = yield from self._connect_steps(self.lanes[i].agent, i)

    def _connect_steps(self, a: int, lane_id: int) -> Generator[None, None, Lane]:
        """Add D's agent to pool agent ``a`` and push a tiny WRITE so the connection
        exists now and its 5-tuple is known before the first real push is routed."""
        agent, h = self.agents[a], self.hello
        before = self.entropy.snapshot()
        name = agent.add_remote_agent(h.agent_metadata)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name != h.agent_name:
            # the metadata names another agent than the Hello: WRITEs addressed to
            # h.agent_name would go to whatever agent NIXL knows by that name
            try:
                agent.remove_remote_agent(name)
            except Exception:
                logger.debug("removing remote agent %s failed", name, exc_info=True)
            raise RuntimeError(f"the Hello's NIXL metadata names agent {name!r}, not {h.agent_name!r}")
        if h.probe_addr and h.probe_len:
            try:
                yield from self._probe_steps(agent, lane_id)
            except BaseException:
                self._remove_remote(a)  # a lane that failed to open leaves no remote agent behind
                raise
        conns = self.entropy.learn(before, h.listen_ports, self.own_port)
        if len(conns) == 1:
            src_ip, src_port, dst_ip, dst_port = conns[0]
            lane = Lane(lane_id, src_ip, src_port, dst_ip, dst_port, agent=a)
        else:  # 0: the connection predates the snapshot; >1: ambiguous. Never guess.
            logger.warning("lane %d to %s: %d candidate connections, 5-tuple unknown", lane_id, h.agent_name, len(conns))
            lane = Lane(lane_id, agent=a)
        if self.path_of is not None and lane.src_port:
            lane.path = self.path_of(lane)
        return lane

    def reachable_steps(self) -> Generator[None, None, None]:
        """Check, without blocking, that D's UCX listeners answer a TCP connect (an
        accept or a refusal both do): NIXL's add_remote_agent connects synchronously and
        would hold the writer for as long as the kernel retries a SYN that a firewall
        drops. Raises when one stays silent for PROBE_TIMEOUT_S of polling."""
        h = self.hello
        targets = [(h.host if is_wildcard(ip) else ip, port) for ip, port in h.listen_addrs]
        if not targets and h.host and h.listen_ports:
            targets = [(h.host, h.listen_ports[0])]
        for ip, port in targets:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setblocking(False)
                err = s.connect_ex((ip, port))
                waited, last = 0.0, time.monotonic()
                while err in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
                    _, writable, _ = select.select([], [s], [], 0)
                    if writable:
                        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        break
                    now = time.monotonic()
                    waited += min(now - last, 0.05)
                    last = now
                    if waited > PROBE_TIMEOUT_S:
                        raise RuntimeError(f"D's UCX listener {ip}:{port} does not answer "
                                           f"(a firewall dropping packets?)")
                    yield
                if err not in (0, errno.ECONNREFUSED, errno.EISCONN):
                    raise RuntimeError(f"D's UCX listener {ip}:{port}: {os.strerror(err)}")

    def _probe_steps(self, agent: Any, lane_id: int) -> Generator[None, None, None]:
        h = self.hello
        n = min(8, h.probe_len)
        loc = agent.get_xfer_descs(np.array([[self.probe_addr, n, 0]], dtype=np.uint64), "DRAM")
        rem = agent.get_xfer_descs(np.array([[h.probe_addr, n, 0]], dtype=np.uint64), "DRAM")
        handle = agent.initialize_xfer("WRITE", loc, rem, h.agent_name)
        try:
            state = agent.transfer(handle)
            waited, last = 0.0, time.monotonic()
            while state == "PROC":
                now = time.monotonic()
                # only time spent polling counts: a writer held elsewhere (a long step)
                # did not progress the probe, so that time is not the peer's fault
                waited += min(now - last, 0.05)
                last = now
                if waited > PROBE_TIMEOUT_S:
                    state = "TIMEOUT"
                    break
                yield
                state = agent.check_xfer_state(handle)
        finally:
            agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"lane {lane_id} probe ended in state {state}")

    def tear_down(self, i: int) -> None:
        """Drop lane ``i``'s remote agent (after a failed WRITE); reopened on next use."""
        lane = self.lanes[i]
        if lane.broken:
            return
        lane.broken = True
        try:
            self.agent(i).remove_remote_agent(self.hello.agent_name)
        except Exception:
            logger.warning("removing %s from lane %d failed", self.hello.agent_name, i, exc_info=True)
