"""The fabric spec: one declarative leaf-spine description shared by every part.

Addressing is hierarchical: host ``h`` under leaf ``l`` is ``l{l}h{h}`` with IP
``<base>.<l>.<2 + h mod 254>.<1 + 4 (h div 254)>`` (one /16 of the /8 per leaf; the
first 254 hosts of a leaf are ``<base>.<l>.<h+2>.1``); its leaf's side of the host
link is the next address of the same /30. So a leaf holds up to 254 x 64 = 16,256
hosts and a fabric up to 256 leaves. The link between leaf ``l`` and spine ``s``
is ``<base>.<l>.1.<4s>/30``: the leaf is ``.4s+1``, the spine ``.4s+2``. So every
address names its place, and routes are one /16 per leaf. Paths follow the up-down rule and are
computed by rule, never by routing tables: hosts under one leaf talk through the
leaf; otherwise the packet goes host -> leaf -> spine -> leaf -> host, the spine
picked by the ECMP hash of the flow's 5-tuple (or by a reservation pinning it).
"""

from __future__ import annotations

import ipaddress
import json
import zlib
from dataclasses import asdict, dataclass, field
from functools import cached_property
import pathlib
from typing import Any

import msgspec
import msgspec.structs

from kvpath.five_tuple import FiveTuple

HASH_FIELDS = ("src_ip", "dst_ip", "proto", "src_port", "dst_port")
PROTO_NUM = {"tcp": 6, "udp": 17}


# The tiers of egress port on a leaf-spine fabric, as the testbed's drop counters and
# ns-3's name them: a host's port to its leaf, a leaf's to a host, a leaf's uplink to a
# spine, a spine's downlink to a leaf.
PORT_TIERS = ("host_up", "leaf_down", "leaf_up", "spine_down")


class FabricSpecError(ValueError):
    pass


class Path(msgspec.Struct, frozen=True, gc=False):
    """Nodes from source host to destination host and the directed links between.

    Untracked by the garbage collector (``gc=False``: it holds strings only, so it can
    be in no reference cycle): the reservation service keeps a path for every
    registered lane, and a full collection that walks hundreds of thousands of them
    stalls every request for tens of milliseconds."""

    nodes: tuple[str, ...]
    spine: str | None
    # computed from nodes (the reservation service reads them on every decision):
    # the directed links, and the switch-to-switch ones, the only links where two
    # paths between the same hosts can differ (host links are common to all of them)
    links: tuple[tuple[str, str], ...] = ()
    core_links: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        links = tuple(zip(self.nodes[:-1], self.nodes[1:]))
        msgspec.structs.force_setattr(self, "links", links)
        msgspec.structs.force_setattr(self, "core_links", links[1:-1])


MAX_LEAVES = 256
MAX_HOSTS_PER_LEAF = 254 * 64


@dataclass(frozen=True)
class FabricSpec:
    leaves: int = 4
    spines: int = 4
    hosts_per_leaf: int = 4
    host_link_gbps: float = 100.0
    spine_link_gbps: float = 100.0
    mtu: int = 9000
    ecmp_hash_fields: tuple[str, ...] = HASH_FIELDS
    ecmp_seed: int = 0
    base_net: str = "10.0.0.0/8"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("leaves", "spines", "hosts_per_leaf"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise FabricSpecError(f"fabric.{name} must be a positive integer, got {v!r}")
        if self.leaves > MAX_LEAVES:
            raise FabricSpecError(f"fabric.leaves must be <= {MAX_LEAVES} (one /16 of the base /8 per leaf)")
        if self.hosts_per_leaf > MAX_HOSTS_PER_LEAF:
            raise FabricSpecError(f"fabric.hosts_per_leaf must be <= {MAX_HOSTS_PER_LEAF} "
                                  "(254 third octets x 64 host /30s in each leaf's /16)")
        if self.spines > 63:
            raise FabricSpecError("fabric.spines must be <= 63 (one /30 per leaf-spine link in <base>.<leaf>.1.0/24)")
        for name in ("host_link_gbps", "spine_link_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise FabricSpecError(f"fabric.{name} must be a positive number, got {v!r}")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65536:
            raise FabricSpecError(f"fabric.mtu must be an integer in [576, 65536], got {self.mtu!r}")
        bad = [f for f in self.ecmp_hash_fields if f not in HASH_FIELDS]
        if bad or not self.ecmp_hash_fields:
            raise FabricSpecError(f"fabric.ecmp_hash_fields must be a non-empty subset of {HASH_FIELDS}, got {bad or '[]'}")
        try:
            net = ipaddress.ip_network(self.base_net)
        except ValueError as e:
            raise FabricSpecError(f"fabric.base_net: {e}") from None
        if net.version != 4 or net.prefixlen > 8:
            raise FabricSpecError("fabric.base_net must be an IPv4 /8 (e.g. 10.0.0.0/8)")

    # ---- loading ----------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FabricSpec":
        if not isinstance(d, dict):
            raise FabricSpecError("fabric spec must be a JSON object")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise FabricSpecError(f"fabric: unknown field(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        if "ecmp_hash_fields" in d:
            d["ecmp_hash_fields"] = tuple(d["ecmp_hash_fields"])
        return cls(**d)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "FabricSpec":
        """A spec file: JSON, or YAML when the name ends in .yaml/.yml."""
        p = pathlib.Path(path)
        try:
            text = p.read_text()
            if p.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:  # OSError, JSON or YAML syntax: all mean "cannot read it"
            raise FabricSpecError(f"cannot read fabric spec {path}: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def resolve(cls, name_or_path: str) -> "FabricSpec":
        """A preset's name (``small``, ``rack4``, ``rack4-os2``, ``rack8``) or a spec file."""
        if name_or_path in PRESETS:
            return PRESETS[name_or_path]
        if not pathlib.Path(name_or_path).exists():
            raise FabricSpecError(f"fabric {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
        return cls.load(name_or_path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["ecmp_hash_fields"] = list(self.ecmp_hash_fields)
        return d

    # ---- addressing ------------------------------------------------------
    def hosts(self) -> list[str]:
        return [self.host_name(l, h) for l in range(self.leaves) for h in range(self.hosts_per_leaf)]

    @staticmethod
    def host_name(leaf: int, host: int) -> str:
        return f"l{leaf}h{host}"

    @staticmethod
    def leaf_name(leaf: int) -> str:
        return f"leaf{leaf}"

    @staticmethod
    def spine_name(spine: int) -> str:
        return f"spine{spine}"

    def locate(self, host: str) -> tuple[int, int]:
        """(leaf, host index) of a host name or IP; FabricSpecError if not in the fabric."""
        try:
            if host.startswith("l") and "h" in host:
                l_s, h_s = host[1:].split("h", 1)
                leaf, idx = int(l_s), int(h_s)
            else:
                octets = ipaddress.ip_address(host).packed
                base = ipaddress.ip_network(self.base_net).network_address.packed
                if octets[0] != base[0]:
                    raise ValueError
                if octets[2] < 2:
                    raise ValueError  # <base>.<l>.0-1.x: leaf-spine links, not hosts
                leaf, idx = octets[1], octets[2] - 2 + 254 * (octets[3] // 4)
        except ValueError:
            raise FabricSpecError(f"{host!r} is not a host of this fabric") from None
        if not (0 <= leaf < self.leaves and 0 <= idx < self.hosts_per_leaf):
            raise FabricSpecError(f"{host!r} is not a host of this fabric ({self.leaves} leaves x {self.hosts_per_leaf} hosts)")
        return leaf, idx

    def host_ip(self, host: str) -> str:
        leaf, idx = self.locate(host)
        return f"{self._base_octet}.{leaf}.{2 + idx % 254}.{1 + 4 * (idx // 254)}"

    def canonical(self, host: str) -> str:
        return self.host_name(*self.locate(host))

    def netns_name(self, prefix: str, node: str) -> str:
        """The testbed namespace of a node (host name or IP, ``leaf<i>``, ``spine<j>``)
        in the fabric whose namespaces are named ``<prefix>-<node>``."""
        if not node.startswith(("leaf", "spine")):
            node = self.canonical(node)
        return f"{prefix}-{node}"

    @cached_property
    def _base_octet(self) -> int:
        # cached: every host_ip() needs it, and parsing base_net was a third of a path's cost
        return ipaddress.ip_network(self.base_net).network_address.packed[0]

    def host_gateway_ip(self, host: str) -> str:
        """The leaf's address on the link to ``host``."""
        leaf, idx = self.locate(host)
        return f"{self._base_octet}.{leaf}.{2 + idx % 254}.{2 + 4 * (idx // 254)}"

    def uplink_ips(self, leaf: int, spine: int) -> tuple[str, str]:
        """(leaf side, spine side) addresses of the leaf-spine link, each in a /30."""
        b = self._base_octet
        return f"{b}.{leaf}.1.{4 * spine + 1}", f"{b}.{leaf}.1.{4 * spine + 2}"

    def leaf_prefix(self, leaf: int) -> str:
        return f"{self._base_octet}.{leaf}.0.0/16"

    # ---- paths by rule ---------------------------------------------------
    def ecmp_hash(self, key: FiveTuple) -> int:
        parts = {
            "src_ip": key.src_ip, "dst_ip": key.dst_ip, "proto": str(PROTO_NUM.get(key.proto, 0)),
            "src_port": str(key.src_port), "dst_port": str(key.dst_port),
        }
        data = "|".join(parts[f] for f in self.ecmp_hash_fields).encode()
        h = zlib.crc32(data, self.ecmp_seed & 0xFFFFFFFF)
        # finalizer: crc32 alone maps neighbouring ports to neighbouring buckets
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        return h

    def path(self, src_host: str, dst_host: str, spine: int | None = None) -> Path:
        sl, _ = self.locate(src_host)
        dl, _ = self.locate(dst_host)
        src, dst = self.canonical(src_host), self.canonical(dst_host)
        if src == dst:
            return Path((src,), None)
        if sl == dl:
            return Path((src, self.leaf_name(sl), dst), None)
        if spine is None or not 0 <= spine < self.spines:
            raise FabricSpecError(f"path {src}->{dst} crosses the spine layer: give a spine in [0, {self.spines})")
        s = self.spine_name(spine)
        return Path((src, self.leaf_name(sl), s, self.leaf_name(dl), dst), s)

    def flow_path(self, src_host: str, dst_host: str, src_port: int, dst_port: int = 0, proto: str = "tcp") -> Path:
        """The path ECMP gives this 5-tuple (the model's hash)."""
        key = FiveTuple(self.host_ip(src_host), self.host_ip(dst_host), src_port, dst_port, proto)
        return self.path(src_host, dst_host, self.ecmp_hash(key) % self.spines)

    def link_gbps(self, link: tuple[str, str]) -> float:
        a, b = link
        return self.spine_link_gbps if a.startswith("spine") or b.startswith("spine") else self.host_link_gbps


# The testbed's presets. Link rates are the datacenter's: the testbed divides them by
# its scale factor B (kvpath testbed up --scale-b).
PRESETS: dict[str, FabricSpec] = {
    "small": FabricSpec(leaves=2, spines=2, hosts_per_leaf=2),
    "rack3": FabricSpec(leaves=3, spines=3, hosts_per_leaf=3),  # an odd spine count: ECMP's hash mod 3
    "rack4": FabricSpec(leaves=4, spines=4, hosts_per_leaf=4),
    "rack8": FabricSpec(leaves=8, spines=4, hosts_per_leaf=2),
    # rack4 with spine links at half the hosts' rate: a leaf's 4 hosts (400 Gbit/s) share
    # 4 uplinks of 50 (200): oversubscribed 2:1
    "rack4-os2": FabricSpec(leaves=4, spines=4, hosts_per_leaf=4, spine_link_gbps=50.0),
}


def check_pools_fit(spec: FabricSpec, n_p: int, n_d: int) -> None:
    """The one rule for whether pools fit a fabric (:func:`pd_placement`: P on leaves
    [0, L/2), D on [L/2, L), one engine per host). A ValueError naming both counts when
    they do not."""
    if spec.leaves < 2:
        raise ValueError("the fabric needs at least 2 leaves (P and D on different leaves)")
    if n_p < 1 or n_d < 1:
        raise ValueError(f"pools need at least one P and one D, got {n_p}P{n_d}D")
    half = spec.leaves // 2
    p_room, d_room = half * spec.hosts_per_leaf, (spec.leaves - half) * spec.hosts_per_leaf
    if n_p > p_room or n_d > d_room:
        raise ValueError(f"pools {n_p}P{n_d}D do not fit: {p_room} hosts for P and {d_room} for D on this fabric")


def pd_placement(spec: FabricSpec, n_p: int, n_d: int) -> tuple[list[str], list[str]]:
    """Where P and D engines go, in the testbed and in simulation alike: P hosts on
    leaves [0, L/2), D hosts on [L/2, L), spread across leaves first, so every push
    crosses the spines. Pools that do not fit raise (:func:`check_pools_fit`)."""
    check_pools_fit(spec, n_p, n_d)
    half = spec.leaves // 2

    def spread(leaves: range, n: int) -> list[str]:
        order = [spec.host_name(l, h) for h in range(spec.hosts_per_leaf) for l in leaves]
        return order[:n]

    return spread(range(half), n_p), spread(range(half, spec.leaves), n_d)
