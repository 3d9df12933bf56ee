"""Path entropy providers: learn a lane's exact 5-tuple (the ECMP input) from its own connection.

The interface is what lane set-up needs: take a snapshot before a lane's connection
opens, then ask which flow the lane is. ``TcpSocketEntropy`` (here: UCX over TCP)
reads the kernel's socket table; the lane's connection is the one new connection to
one of the peer's UCX listening ports, which the peer announces in its handshake.

On a RoCEv2 fabric the entropy is the QP's UDP source port (dst port 4791) and a
provider would answer from the QP: with a zero flow label the kernel derives it from
the two QP numbers, UCX's RC transport sets ``0xC000 | (UCX_IB_ROCE_PATH_FACTOR *
path_index)``, or ``mlx5dv_modify_qp_udp_sport`` sets it explicitly. NIXL does not
expose a UCX endpoint's QP numbers, so that provider is a design (docs/connector-protocol.md, "Real fabrics (RoCE)"),
not code.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol

Flow = tuple[str, int, str, int]  # src ip, src port, dst ip, dst port (protocol: the provider's)


class PathEntropyProvider(Protocol):
    proto: str

    def snapshot(self) -> object: ...

    def learn(self, before: object, peer_ports: Iterable[int], own_port: int) -> list[Flow]:
        """The flows opened since ``before``: exactly one when the lane can be told apart."""
        ...


class TcpSocketEntropy:
    """Lanes over UCX TCP: the kernel's connection table of this process."""

    proto = "tcp"

    def snapshot(self) -> set[Flow]:
        return remote_endpoints()

    def learn(self, before: object, peer_ports: Iterable[int], own_port: int) -> list[Flow]:
        assert isinstance(before, set)
        return lane_connection(before, peer_ports, own_port)


def remote_endpoints() -> set[tuple[str, int, str, int]]:
    """This process's TCP connections whose far end is another process."""
    import psutil

    conns = psutil.Process().net_connections("tcp")
    local = {(c.laddr.ip, c.laddr.port) for c in conns if c.laddr}
    out = set()
    for c in conns:
        if c.raddr and c.status == "ESTABLISHED" and (c.raddr.ip, c.raddr.port) not in local:
            out.add((c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port))
    return out


# Held around creating an agent and diffing listening_sockets(), so the listening
# port a new agent opened is not confused with another's.
LISTEN_LOCK = threading.Lock()


def listening_sockets() -> set[tuple[str, int]]:
    """(address, port) of each TCP socket this process listens on."""
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
            if c.status == "LISTEN" and c.laddr}


def lane_connection(
    before: set[tuple[str, int, str, int]], peer_ports: Iterable[int], own_port: int
) -> list[tuple[str, int, str, int]]:
    """The connections opened since ``before`` snapshot: to one of the peer's UCX
    listening ports when it told us them (exact), else any new one except our own
    control socket's (the fallback for peers that do not send them)."""
    new = remote_endpoints() - before
    ports = set(peer_ports)
    if ports:
        return sorted(c for c in new if c[3] in ports)
    return sorted(c for c in new if c[1] != own_port)


