"""Lanes from one P worker to one D worker: open, learn each one's 5-tuple, tear down.

A lane is one NIXL agent of P's with its own UCX TCP connection to D, so its own
source port and its own ECMP path. Lanes open on the first contact (the handshake)
and are kept. A lane whose WRITE had to be abandoned is torn down (its remote
agent removed, so UCX drops the connection and reads no more source memory) and
reopened, with a new source port, when it is next used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from connector import messages as M
from connector.nixl_io import lane_connection, remote_endpoints, wait_xfer

logger = logging.getLogger(__name__)


@dataclass
class Lane:
    lane_id: int
    src_ip: str = ""
    src_port: int = 0  # 0: not learned (the peer's connection could not be told apart)
    dst_ip: str = ""
    dst_port: int = 0
    broken: bool = False

    def five_tuple(self) -> tuple[str, int, str, int, str]:
        return (self.src_ip, self.src_port, self.dst_ip, self.dst_port, "tcp")


class LaneSet:
    """The lanes of one (P worker, D worker) pair. Writer thread only."""

    def __init__(self, hello: M.Hello, agents: list[Any], probe_addr: int, own_port: int):
        self.hello = hello
        self.agents = agents
        self.probe_addr = probe_addr
        self.own_port = own_port
        self.lanes: list[Lane] = [Lane(i, broken=True) for i in range(len(agents))]

    def open_all(self) -> None:
        for i in range(len(self.agents)):
            self.open(i)

    def open(self, i: int) -> Lane:
        """(Re)open lane ``i``: add D's agent and push a tiny WRITE so the connection
        exists now and its 5-tuple is known before the first real push is routed."""
        agent, h = self.agents[i], self.hello
        before = remote_endpoints()
        agent.add_remote_agent(h.agent_metadata)
        if h.probe_addr and h.probe_len:
            n = min(8, h.probe_len)
            loc = agent.get_xfer_descs(np.array([[self.probe_addr, n, 0]], dtype=np.uint64), "DRAM")
            rem = agent.get_xfer_descs(np.array([[h.probe_addr, n, 0]], dtype=np.uint64), "DRAM")
            handle = agent.initialize_xfer("WRITE", loc, rem, h.agent_name)
            state = wait_xfer(agent, handle, timeout_s=5.0)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"lane {i} probe ended in state {state}")
        conns = lane_connection(before, h.listen_ports, self.own_port)
        if len(conns) == 1:
            src_ip, src_port, dst_ip, dst_port = conns[0]
            lane = Lane(i, src_ip, src_port, dst_ip, dst_port)
        else:  # 0: the connection predates the snapshot; >1: ambiguous. Never guess.
            logger.warning("lane %d to %s: %d candidate connections, 5-tuple unknown", i, h.agent_name, len(conns))
            lane = Lane(i)
        self.lanes[i] = lane
        return lane

    def ensure(self, i: int) -> Lane:
        lane = self.lanes[i]
        return self.open(i) if lane.broken else lane

    def tear_down(self, i: int) -> None:
        """Drop lane ``i``'s connection: after this UCX moves no more bytes on it."""
        lane = self.lanes[i]
        if lane.broken:
            return
        lane.broken = True
        try:
            self.agents[i].remove_remote_agent(self.hello.agent_name)
        except Exception:
            logger.warning("removing %s from lane %d failed", self.hello.agent_name, i, exc_info=True)
