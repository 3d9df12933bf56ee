"""What a trace says about the run that made it: the one reader of a trace's header.

The testbed and the serving simulation write different things into ``Header.meta``
(``docs/trace.md``): the testbed its links' token-bucket burst and buffer, the
simulation its network constants and iteration-time model. :class:`TraceSetup` reads
each of them, and the fabric, the time scale and the pools, with one rule each, for
every consumer (``kvpath bridge`` compare, calibrate, report and simulate). The meta
keys are named here once; the simulation writes its header with them.

Each value is parsed when first asked for, so a malformed field fails only the consumer
that needs it, with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvpath.deployment import parse_pools
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.reservation.wire import RESERVE_AT
from kvpath.trace.records import Header, Trace

__all__ = [
    "META_POOLS", "META_BURST", "META_QUEUE", "META_DROPS", "META_RETRANS", "META_NET", "META_ITERATION_TIME", "META_RESERVE_AT", "META_TIME_SCALE",
    "META_SOURCE", "META_BACKEND", "NET_FIELDS", "DEFAULT_ITERATION_TIME", "header_fabric", "TraceSetup",
]

META_POOLS = "pools"  # NPmD (kvpath.deployment), both writers
META_BURST = "burst_bytes"  # the testbed links' token-bucket burst
META_QUEUE = "queue_bytes"  # the testbed links' buffer per egress port
META_DROPS = "drops"  # packets the testbed's egress ports dropped during the run (tbf over its limit)
META_RETRANS = "tcp_retrans_segs"  # TCP segments the P and D hosts retransmitted during the run
META_NET = "net"  # the simulation's network constants: NET_FIELDS
META_ITERATION_TIME = "iteration_time"  # IterationTimeModel.to_dict() of the simulation
META_RESERVE_AT = "reserve_at"  # when lanes were reserved (kvpath.reservation.wire.RESERVE_AT)
META_TIME_SCALE = "time_scale"  # modelled seconds -> trace seconds, when not a testbed trace
META_SOURCE = "source"  # who wrote the trace
META_BACKEND = "backend"  # the simulation's network backend
NET_FIELDS = ("overhead_s", "efficiency", "burst_bytes")
DEFAULT_ITERATION_TIME = ("llama-3-8b", "h100")  # (model, accelerator) when the header names none


def header_fabric(header: Header) -> FabricSpec:
    """The header's fabric spec at the rates the run had, tier by tier: when the header
    has the testbed's rates (the scale model), ``link_mbit`` on the spine links and
    ``host_link_mbit`` on the host links (a trace without the latter: the spine rate
    times the spec's host/spine ratio, as the testbed scales every tier by one factor);
    else the spec's own."""
    spec = FabricSpec.from_dict(header.fabric)
    if header.link_mbit:
        spine = header.link_mbit / 1000
        host = (header.host_link_mbit / 1000 if header.host_link_mbit
                else spine * (spec.host_link_gbps / spec.spine_link_gbps))  # ratio first: exact at 1
        spec = dataclasses.replace(spec, host_link_gbps=host, spine_link_gbps=spine)
    return spec


def _byte_count(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"header meta.{key} must be an integer >= 0, got {v!r}")
    return v


@dataclass(frozen=True)
class TraceSetup:
    """A trace's run as its header (and, for the pools, its requests) describe it."""

    trace: Trace

    @property
    def header(self) -> Header:
        return self.trace.header

    @property
    def meta(self) -> dict[str, Any]:
        return self.trace.header.meta

    @property
    def is_testbed(self) -> bool:
        """A testbed run: its links ran at ``link_mbit`` (the scale model's rates)."""
        return bool(self.header.link_mbit)

    @cached_property
    def fabric(self) -> FabricSpec:
        """:func:`header_fabric`; a FabricSpecError (a ValueError) when the header's is bad."""
        return header_fabric(self.header)

    @cached_property
    def time_scale(self) -> float:
        """Modelled (datacenter) seconds -> trace seconds: B/S for a testbed trace, as the
        emulated engines scale compute; else ``meta.time_scale``, else 1."""
        if self.is_testbed:
            return self.header.scale_b / self.header.scale_s
        v = self.meta.get(META_TIME_SCALE, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"header meta.{META_TIME_SCALE} must be a number > 0, got {v!r}")
        return float(v)

    @cached_property
    def _iteration_time(self) -> tuple[IterationTimeModel | None, str | None]:
        """(the header's model, None), (None, why it is unusable), or (None, None) when absent."""
        d = self.meta.get(META_ITERATION_TIME)
        if d is None:
            return None, None
        if not isinstance(d, dict):
            return None, f"must be an object, got {type(d).__name__}"
        try:
            return IterationTimeModel.from_dict(d), None
        except (ValueError, KeyError, TypeError) as e:  # ModelSpecError is a ValueError; an unknown preset a KeyError
            return None, str(e)

    @property
    def iteration_time(self) -> IterationTimeModel:
        """The header's iteration-time model, else the default preset when it names none.
        A ValueError when the header's is unusable: a replay that checks fidelity must
        not run on another model than the run's."""
        itm, why = self._iteration_time
        if itm is not None:
            return itm
        if why is not None:
            raise ValueError(f"header meta.{META_ITERATION_TIME}: {why}")
        return IterationTimeModel.preset(*DEFAULT_ITERATION_TIME)

    def iteration_time_or_preset(self) -> tuple[IterationTimeModel, str]:
        """The header's model, else the default preset also when the header's is unusable;
        and a caption line saying which (a figure can still be drawn, and says so)."""
        itm, why = self._iteration_time
        if itm is not None:
            return itm, f"iteration-time model from the trace header ({itm.model.name} on {itm.accel.name})"
        reason = "the header has no iteration_time" if why is None else f"the header's iteration_time is unusable ({why})"
        model, accel = DEFAULT_ITERATION_TIME
        return IterationTimeModel.preset(model, accel), f"{reason}: the {model} on {accel} preset is used"

    @cached_property
    def pools(self) -> tuple[int, int] | None:
        """``meta.pools`` (``8P8D``) when it parses, else the number of distinct P and D
        instances of the requests; None when neither gives both."""
        try:
            return parse_pools(self.meta[META_POOLS])
        except (KeyError, ValueError):
            pass
        n_p = len({q.p_instance for q in self.trace.requests if q.p_instance})
        n_d = len({q.d_instance for q in self.trace.requests if q.d_instance})
        return (n_p, n_d) if n_p and n_d else None

    @cached_property
    def burst_bytes(self) -> int | None:
        """The testbed links' token-bucket burst (``meta.burst_bytes``); None when not recorded."""
        return _byte_count(self.meta, META_BURST)

    @cached_property
    def drops(self) -> int | None:
        """Packets the testbed's ports dropped in the run (``meta.drops``); None when not recorded."""
        return _byte_count(self.meta, META_DROPS)

    @cached_property
    def retransmits(self) -> int | None:
        """TCP segments the engine hosts retransmitted (``meta.tcp_retrans_segs``); None when not recorded."""
        return _byte_count(self.meta, META_RETRANS)

    @cached_property
    def queue_bytes(self) -> int | None:
        """The testbed links' buffer per egress port (``meta.queue_bytes``); None when not recorded."""
        return _byte_count(self.meta, META_QUEUE)

    @property
    def net(self) -> dict[str, Any] | None:
        """The simulation's network constants (``meta.net``, the NET_FIELDS it has); None
        when the header has no such object (a testbed trace)."""
        net = self.meta.get(META_NET)
        return {k: net[k] for k in NET_FIELDS if k in net} if isinstance(net, dict) else None

    @property
    def reserve_at(self) -> str | None:
        """``meta.reserve_at`` when it is one of RESERVE_AT, else None."""
        v = self.meta.get(META_RESERVE_AT)
        return v if v in RESERVE_AT else None
