"""The 5-tuple that names a flow: what the fabric's ECMP hash keys on, what a trace
records per flow, what a spine's counters count by and what a connector lane learns.
Every part uses this one type."""

from __future__ import annotations

from typing import Any

import msgspec

PROTOS = ("tcp", "udp")


class FiveTuple(msgspec.Struct, frozen=True):
    """Frozen, so hashable: a dict key for per-flow counters and caches."""

    src_ip: str
    dst_ip: str
    src_port: int
    dst_port: int
    proto: str = "tcp"

    def reverse(self) -> "FiveTuple":
        """The same connection seen from the other end (the ACKs' direction)."""
        return FiveTuple(self.dst_ip, self.src_ip, self.dst_port, self.src_port, self.proto)

    def to_dict(self) -> dict[str, Any]:
        """Fields in declaration order (src_ip, dst_ip, src_port, dst_port, proto)."""
        return msgspec.structs.asdict(self)
