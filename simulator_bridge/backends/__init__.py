"""The network backends (``base.py``: what one is, the registry and the dispatch). Each
module below registers one when imported; the import order is ``names()``'s order.
A new backend is a new module here and its line below."""

from kvpath.bridge.backends.base import LaneHooks, NetworkBackend, Replay, backend_type, make, names, register
from kvpath.bridge.backends import flow, trivial, ns3  # noqa: F401,E402  (registers flow, trivial, ns3)

__all__ = ["LaneHooks", "NetworkBackend", "Replay", "backend_type", "make", "names", "register"]
