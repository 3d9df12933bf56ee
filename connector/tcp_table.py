"""This network namespace's TCP sockets, from /proc/net/tcp and tcp6 (Linux).

D's fence uses it to tell that P's lane connections are closed and drained: the
kernel saw P's FIN or RST (sent after P's last byte) and D's UCX read everything
before it, so no byte of P's can land in D's memory any more.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

ESTABLISHED = 0x01


@dataclass(frozen=True)
class TcpSocket:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    rx_queue: int  # bytes received and not yet read by the application
    inode: int = 0  # the socket's inode (0: a socket no process holds, e.g. TIME_WAIT)

    def drained(self) -> bool:
        """The peer closed the connection and everything it sent was read."""
        return self.state != ESTABLISHED and self.rx_queue == 0


def _addr(hexaddr: str) -> tuple[str, int]:
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip_hex, 16)))
    else:  # four little-endian 32-bit words
        ip6 = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        ip = str(ip6.ipv4_mapped or ip6)
    return ip, int(port_hex, 16)


def sockets() -> list[TcpSocket]:
    """TCP sockets of this namespace."""
    out: list[TcpSocket] = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            rx = int(parts[4].split(":")[1], 16)
            out.append(TcpSocket(_addr(parts[1]), _addr(parts[2]), int(parts[3], 16), rx, int(parts[9])))
    return out


def own_socket_inodes() -> set[int]:
    """Inodes of the sockets this process holds (its /proc/self/fd links)."""
    out: set[int] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def lanes_drained(local_ports: set[int], lanes: set[tuple[str, int]],
                  announced: set[tuple[str, int]] | None = None) -> bool | None:
    """Are all connections of ``lanes`` (remote ip, port) into ``local_ports`` closed and
    drained? False as soon as one is not. Without known lanes, None (cannot tell):
    nothing tells P's connections apart (a peer named by host name, lanes leaving from
    another interface than the side channel's), so the caller falls back to a time bound.

    ``announced``: every lane any peer announced (``lanes`` among them). A connection
    into ``local_ports`` from none of them that is not drained also makes the answer
    None: it may be one of this P's that D was never told about (a lost announcement,
    NAT rewriting P's source), and "drained" must never be said while it may deliver."""
    if not lanes:
        return None
    table = sockets()
    unknown: list[TcpSocket] = []
    for s in table:
        if s.local[1] not in local_ports or s.remote[1] == 0:
            continue  # not into our ports, or the listening socket
        if s.remote in lanes:
            if not s.drained():
                return False
        elif announced is not None and s.remote not in announced and not s.drained():
            unknown.append(s)
    if unknown:
        # a connection whose other end is a socket of this very process (UCX connects a
        # worker to itself) is not a peer's; any other could be this P's
        ours = own_socket_inodes()
        ends = {(s.local, s.remote): s.inode for s in table}  # the full 4-tuple: local ports are shared
        if any(ends.get((s.remote, s.local)) not in ours for s in unknown):
            return None
    return True
