"""What a network backend is, and the registry of them: the one place a backend's name
is turned into what it does.

A backend computes flow completion times on a fabric (``FabricSpec``) from flows
(``FlowSpec``: endpoints, bytes, start time, spine) and the network constants every
backend shares (``NetParams``: from a trace's header, ``compare.header_net_params``, or
from the command line). Its class says what else it can do:

- ``replay``: the FCT of each flow, each on its given spine (``compare``'s replay of a
  trace's measured flows, and calibration's network runs); a packet-level backend also
  counts the packets it dropped (``counts_drops``).
- ``serve``: the network step of the serving simulation (``serving_sim.simulate``), whose
  lanes the reservation code decides on the simulated clock. A ``closed_loop`` backend
  calls the reservation code while its flows run; another has the lanes decided first,
  on the clock of the backend ``lanes_by`` names (None: every flow alone, so a
  reservation ends as soon as it is made), and replays the flows on them.
- its own parameters (``options_type``; ns3: ``Ns3Params``), whether ``NetParams.efficiency``
  applies (``fits_efficiency``: calibration fits it), and the packet a token bucket
  must hold (``packet_bytes``: 0 for a fluid model).

A backend registers itself by name (``@register``); ``names()`` lists them in
registration order (the order ``--backend: choose from ...`` gives), ``backend_type``
and ``make`` are the dispatch. Adding one is a module in this package that defines and
registers the class, and its import in ``backends/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from kvpath.bridge.flow_model import FlowSpec, NetParams
from kvpath.fabric import FabricSpec

__all__ = ["LaneHooks", "NetworkBackend", "Replay", "backend_type", "make", "names", "register"]


@dataclass
class Replay:
    """One run of a backend: FCT per flow (seconds); packets dropped, in all and per tier
    of port (``kvpath.fabric.PORT_TIERS``), None from a backend that models no queue;
    ``info``: what the serving simulation adds to its run's info (``simulate``'s second value)."""

    fct_s: np.ndarray
    drops: int | None = None
    tier_drops: dict[str, int] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class LaneHooks:
    """The reservation code on the simulated clock (``FlowModel.run``'s arguments):
    ``decide(i, now)`` picks flow i's spine at ``decide_at[i]``, ``on_end(i, now)``
    releases it when its last byte arrives."""

    decide: Callable[[int, float], int | None]
    decide_at: np.ndarray
    on_end: Callable[[int, float], None]
    # P's pushes at its NIC (flow_model.UplinkGate), and each flow's wait for a slot
    # (filled by the backend): only a closed-loop backend runs them
    gate: Any = None
    waited: np.ndarray | None = None


class NetworkBackend(ABC):
    """A network backend on one fabric with one set of constants; see the module's docstring."""

    name: ClassVar[str]
    closed_loop: ClassVar[bool] = False  # serve: runs the reservation code on its own clock
    lanes_by: ClassVar[str | None] = None  # serve, not closed loop: the backend whose clock decides the lanes
    counts_drops: ClassVar[bool] = False  # replay: reports packets dropped (a packet-level model)
    fits_efficiency: ClassVar[bool] = True  # NetParams.efficiency applies (False: it models headers itself)
    options_type: ClassVar[type | None] = None  # its own parameters' type (None: it has none)

    def __init__(self, spec: FabricSpec, net: NetParams, options: Any = None):
        self.spec, self.net, self.options = spec, net, options

    @abstractmethod
    def replay(self, flows: list[FlowSpec]) -> Replay:
        """Each flow on its ``FlowSpec.spine``."""

    def packet_bytes(self) -> int:
        """The packet a token bucket must hold (its burst must exceed it); 0: a fluid model."""
        return 0

    def serve(self, flows: list[FlowSpec], hooks: LaneHooks) -> Replay:
        """The serving simulation's network step: lanes decided by ``hooks`` (``lanes_by``'s
        clock), then the flows replayed on them. A closed-loop backend overrides this."""
        if hooks.gate is not None:
            raise ValueError(f"network backend {self.name!r}: a cap on pushes per uplink (uplink_pushes) needs a "
                             f"closed-loop backend (flow)")
        spines: list[int | None] = [None] * len(flows)

        def decide(i: int, now: float) -> int | None:
            spines[i] = hooks.decide(i, now)
            return spines[i]

        if self.lanes_by is None:  # flows never meet (each is alone): a reservation ends as soon as it is made
            for i in np.argsort(hooks.decide_at, kind="stable"):
                now = float(hooks.decide_at[i])
                decide(int(i), now)
                hooks.on_end(int(i), now)
        else:
            make(self.lanes_by, self.spec, self.net, self.options).serve(
                flows, LaneHooks(decide, hooks.decide_at, hooks.on_end))
        return self.replay([FlowSpec(f.src, f.dst, f.bytes, f.start_s, spines[i]) for i, f in enumerate(flows)])


_REGISTRY: dict[str, type[NetworkBackend]] = {}


def register(cls: type[NetworkBackend]) -> type[NetworkBackend]:
    """Class decorator: ``cls`` under ``cls.name``. A backend that is not closed loop must
    name a closed-loop one (registered first) for its lanes, or none."""
    if cls.name in _REGISTRY:
        raise ValueError(f"network backend {cls.name!r} is registered already")
    if not cls.closed_loop and cls.lanes_by is not None and not (
            cls.lanes_by in _REGISTRY and _REGISTRY[cls.lanes_by].closed_loop):
        raise ValueError(f"network backend {cls.name!r}: lanes_by {cls.lanes_by!r} is no closed-loop backend")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    return tuple(_REGISTRY)


def backend_type(name: str) -> type[NetworkBackend]:
    """The backend registered as ``name``; a ValueError naming the choices otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {', '.join(_REGISTRY)}, got {name!r}") from None


def make(name: str, spec: FabricSpec, net: NetParams, options: Any = None) -> NetworkBackend:
    """Backend ``name`` on ``spec`` with ``net``. ``options``: a backend's own parameters;
    a backend whose ``options_type`` it is not gets None (its defaults), so a caller may
    pass one backend's options to every backend."""
    cls = backend_type(name)
    own = cls.options_type is not None and isinstance(options, cls.options_type)
    return cls(spec, net, options if own else None)
