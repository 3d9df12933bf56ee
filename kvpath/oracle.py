"""Path oracles: which path does a lane (a flow's 5-tuple) take?

The model oracle answers from the fabric spec's hash; it is the only one so far.
A kernel oracle for the testbed (``ip route get``) and a probing oracle for real
fabrics are to implement the same ``PathOracle`` method; neither exists yet.
"""

from __future__ import annotations

from typing import Protocol

from kvpath.fabric import FabricSpec, Path


class PathOracle(Protocol):
    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path: ...


class ModelOracle:
    """Paths by the fabric spec's rule and ECMP hash; cached (the answer never changes)."""

    def __init__(self, spec: FabricSpec):
        self.spec = spec
        self._cache: dict[tuple[str, str, int, int, str], Path] = {}

    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path:
        key = (src_host, dst_host, src_port, dst_port, proto)
        p = self._cache.get(key)
        if p is None:
            p = self.spec.flow_path(src_host, dst_host, src_port, dst_port, proto)
            if len(self._cache) > 1_000_000:
                self._cache.clear()
            self._cache[key] = p
        return p
