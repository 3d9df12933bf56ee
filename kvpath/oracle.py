"""Path oracles: which path does a lane (a flow's 5-tuple) take?

- :class:`ModelOracle` answers from the fabric spec's own hash (simulation, planning).
- :class:`KernelOracle` asks the kernel of an emulated fabric (the testbed): the
  source leaf's ``ip route get`` with the full 5-tuple returns the next hop that the
  kernel's multipath hash picks, which is the spine the flow's packets take.

On a real fabric neither applies: it would need a probing oracle (traceroute-style, per
5-tuple), which kvpath does not have.
"""

from __future__ import annotations

import re
import subprocess
from typing import Callable, Iterable, Protocol

from kvpath.fabric import FabricSpec, FabricSpecError, Path

_DEV = re.compile(r"\bvia \S+ dev s(\d+)\b")


class PathOracle(Protocol):
    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path: ...


Key = tuple[str, str, int, int, str]


class ModelOracle:
    """Paths by the fabric spec's rule and ECMP hash; cached (the answer never changes)."""

    def __init__(self, spec: FabricSpec):
        self.spec = spec
        self._cache: dict[Key, Path] = {}

    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path:
        key = (src_host, dst_host, src_port, dst_port, proto)
        p = self._cache.get(key)
        if p is None:
            p = self.spec.flow_path(src_host, dst_host, src_port, dst_port, proto)
            if len(self._cache) > 1_000_000:
                self._cache.clear()
            self._cache[key] = p
        return p


class TableOracle:
    """Paths from a table of known answers: (src host, dst host, src port, dst port) ->
    spine index (None within a leaf). For a log replayed, or lanes laid out in simulation."""

    def __init__(self, spec: FabricSpec, table: dict[tuple[str, str, int, int], int | None] | None = None):
        self.spec = spec
        self.table = dict(table or {})

    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path:
        try:
            spine = self.table[(src_host, dst_host, src_port, dst_port)]
        except KeyError:
            raise FabricSpecError(f"no known path for {src_host}:{src_port} -> {dst_host}:{dst_port}") from None
        return self.spec.path(src_host, dst_host, spine)


class KernelOracle:
    """Paths as the testbed's kernel forwards them. ``ns_of`` maps a fabric node
    (host, ``leaf<i>``) to its network namespace. Lookups are batched per source leaf
    (one ``ip -batch`` per call to :meth:`paths`) and cached: the hash seed is fixed
    and the routes do not change while the fabric stands."""

    def __init__(self, spec: FabricSpec, ns_of: Callable[[str], str]):
        self.spec = spec
        self.ns_of = ns_of
        self._cache: dict[Key, Path] = {}

    @classmethod
    def for_prefix(cls, spec: FabricSpec, prefix: str) -> "KernelOracle":
        """The oracle of a running testbed whose namespaces are ``<prefix>-<node>``."""
        return cls(spec, lambda node: spec.netns_name(prefix, node))

    def path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path:
        return self.paths([(src_host, dst_host, src_port, dst_port, proto)])[0]

    def paths(self, keys: Iterable[Key]) -> list[Path]:
        keys = list(keys)
        todo: dict[int, list[Key]] = {}  # source leaf -> keys that cross the spines
        for k in keys:
            if k in self._cache:
                continue
            src, dst, sport, dport, proto = k
            if proto not in ("tcp", "udp"):
                raise FabricSpecError(f"proto must be tcp or udp, got {proto!r}")
            for port, name in ((sport, "src_port"), (dport, "dst_port")):
                if not 0 <= int(port) <= 65535:
                    raise FabricSpecError(f"{name} must be in [0, 65535], got {port!r}")
            sl, _ = self.spec.locate(src)
            dl, _ = self.spec.locate(dst)
            if sl == dl:
                self._cache[k] = self.spec.path(src, dst)
            else:
                todo.setdefault(sl, []).append(k)
        for leaf, ks in todo.items():
            for k, spine in zip(ks, self._route_get(leaf, ks)):
                self._cache[k] = self.spec.path(k[0], k[1], spine)
        return [self._cache[k] for k in keys]

    def _route_get(self, leaf: int, keys: list[Key]) -> list[int]:
        s = self.spec
        lines = []
        for src, dst, sport, dport, proto in keys:
            _, idx = s.locate(src)
            lines.append(f"route get {s.host_ip(dst)} from {s.host_ip(src)} iif h{idx} "
                         f"ipproto {proto} sport {sport} dport {dport}")
        ns = self.ns_of(s.leaf_name(leaf))
        r = subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n", text=True,
                           capture_output=True, timeout=30)
        spines = [int(m.group(1)) for m in _DEV.finditer(r.stdout)]
        if r.returncode != 0 or len(spines) != len(keys):
            raise RuntimeError(f"ip route get in {ns} answered {len(spines)} of {len(keys)} lookups: "
                               f"{r.stderr.strip() or r.stdout[-300:]}")
        return spines
