"""An emulated leaf-spine fabric on one machine: a network namespace per host, leaf
and spine, real kernel forwarding, ECMP by the kernel's 5-tuple hash.

Built from a :class:`kvpath.fabric.FabricSpec` with pyroute2:

- namespaces ``<prefix>-<node>`` (``kvp-<run>-l0h1``, ``kvp-<run>-leaf0``, ...);
- veth links with the spec's hierarchical addresses: in a host ``eth0``; in a leaf
  ``h<i>`` (down to host i) and ``s<j>`` (up to spine j); in a spine ``l<i>``;
- routes: hosts default via their leaf; a leaf reaches every other leaf's /16 by a
  multipath route over all spines; a spine reaches each leaf's /16 over its link;
- ECMP on the leaves: ``fib_multipath_hash_policy=3`` with fields 0x0037 (the
  5-tuple) and a fixed seed, which is deterministic across runs and rebuilds (policy 1
  is not across veth: the socket's random hash travels with the packet);
- every link shaped by tbf at its testbed rate in both directions; cubic congestion
  control in every host namespace (UCX's sockets inherit it; the host default here is
  bbr, which retransmits heavily under tbf);
- per-5-tuple byte counters on the spines (an nftables dynamic set with counters on
  the forward hook), so a flow's measured spine is exact while flows overlap.

Teardown always runs (context manager and SIGTERM/SIGINT); :func:`down` removes the
leftovers of a killed run by their name prefix.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Iterator

from pyroute2 import IPRoute, netns
from pyroute2.netns import popns, pushns

from kvpath.fabric import FabricSpec

logger = logging.getLogger(__name__)

PREFIX = "kvp"  # every namespace the testbed makes starts with this
HASH_FIELDS_5TUPLE = 0x0037  # src ip, dst ip, ip proto, src port, dst port
DEFAULT_KERNEL_SEED = 0x6B767061  # the kernel picks a random seed for 0: never use 0


class FabricBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class LinkShaping:
    """How the testbed's links are shaped (tbf on every veth end, both directions)."""

    host_mbit: float
    spine_mbit: float
    burst_bytes: int = 128 * 1024  # under ~64 KB tbf splits GSO packets and costs 4-5x CPU
    queue_bytes: int = 1 << 20  # tbf's limit: the drop-tail queue of each egress port

    def __post_init__(self) -> None:
        for name in ("host_mbit", "spine_mbit"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise FabricBuildError(f"shaping.{name} must be a positive number of Mbit/s, got {v!r}")
        if self.burst_bytes < 1500 or self.queue_bytes < self.burst_bytes:
            raise FabricBuildError("shaping.burst_bytes must be >= 1500 and shaping.queue_bytes >= burst_bytes")

    @classmethod
    def scaled(cls, spec: FabricSpec, b: float, **kw: int) -> "LinkShaping":
        """The spec's datacenter rates divided by the scale model's B."""
        if b <= 0:
            raise FabricBuildError(f"scale B must be > 0, got {b!r}")
        return cls(host_mbit=spec.host_link_gbps * 1000 / b, spine_mbit=spec.spine_link_gbps * 1000 / b, **kw)


@dataclass(frozen=True)
class Port:
    """One end of a link: its namespace, interface and address."""

    node: str
    ns: str
    ifname: str
    ip: str


@dataclass
class NetnsFabric:
    """A built fabric; use as a context manager (``with NetnsFabric(spec, shaping) as f``)."""

    spec: FabricSpec
    shaping: LinkShaping
    run_id: str = field(default_factory=lambda: secrets.token_hex(2))
    kernel_seed: int = 0
    counters: bool = True
    # A management network (unshaped, off the fabric): a bridge in <prefix>-mgmt with
    # every host's mgmt0 on it and one veth from the root namespace, so a proxy or
    # client in the root namespace reaches the engines' HTTP ports without touching
    # the fabric's links (as a datacenter's front-end network would).
    mgmt: bool = False
    links: list[tuple[Port, Port]] = field(default_factory=list, init=False)
    built: bool = field(default=False, init=False)
    _old_handlers: dict[int, object] = field(default_factory=dict, init=False, repr=False)

    # -- names -----------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"{PREFIX}-{self.run_id}"

    def ns(self, node: str) -> str:
        """The namespace of a fabric node (host name or IP, ``leaf<i>``, ``spine<j>``)."""
        return self.spec.netns_name(self.prefix, node)

    def nodes(self) -> list[str]:
        s = self.spec
        return (s.hosts() + [s.leaf_name(i) for i in range(s.leaves)] + [s.spine_name(j) for j in range(s.spines)])

    @property
    def seed(self) -> int:
        return self.kernel_seed or self.spec.ecmp_seed or DEFAULT_KERNEL_SEED

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> "NetnsFabric":
        self._trap_signals()
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _trap_signals(self) -> None:
        """SIGTERM (and SIGINT) tear the fabric down before the process ends. Only the
        main thread can install handlers; elsewhere the context manager still cleans up."""
        def handler(signum: int, frame: FrameType | None) -> None:
            self.teardown()
            raise SystemExit(128 + signum)

        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            self._old_handlers.clear()

    def build(self) -> None:
        t0 = time.monotonic()
        s = self.spec
        taken = [n for n in netns.listnetns() if n.startswith(self.prefix + "-")]
        if taken:
            raise FabricBuildError(f"namespaces of run {self.run_id} exist already ({taken[0]}, ...): "
                                   f"`kvpath testbed down` removes them")
        self.built = True  # from here on teardown has something to do
        for node in self.nodes():
            netns.create(self.ns(node))
        for host in s.hosts():
            leaf, idx = s.locate(host)
            self._link(Port(host, self.ns(host), "eth0", s.host_ip(host)),
                       Port(s.leaf_name(leaf), self.ns(s.leaf_name(leaf)), f"h{idx}", s.host_gateway_ip(host)),
                       self.shaping.host_mbit)
        for leaf in range(s.leaves):
            for spine in range(s.spines):
                lip, sip = s.uplink_ips(leaf, spine)
                self._link(Port(s.leaf_name(leaf), self.ns(s.leaf_name(leaf)), f"s{spine}", lip),
                           Port(s.spine_name(spine), self.ns(s.spine_name(spine)), f"l{leaf}", sip),
                           self.shaping.spine_mbit)
        self._sysctls()
        self._routes()
        if self.mgmt:
            self._mgmt()
        if self.counters:
            for spine in range(s.spines):
                nft(self.ns(s.spine_name(spine)), NFT_FLOW_COUNTERS)
        logger.info("fabric %s built: %d leaves x %d spines x %d hosts in %.1f s (links %.0f/%.0f Mbit/s)",
                    self.prefix, s.leaves, s.spines, s.hosts_per_leaf, time.monotonic() - t0,
                    self.shaping.host_mbit, self.shaping.spine_mbit)

    def teardown(self) -> None:
        """Delete every namespace of this run (their veths go with them). Idempotent."""
        if self.built:
            n = down(self.prefix)
            logger.info("fabric %s torn down (%d namespaces)", self.prefix, n)
            self.built = False
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)  # type: ignore[arg-type]
            except ValueError:
                pass
        self._old_handlers.clear()

    # -- pieces ------------------------------------------------------------------------
    def _link(self, a: Port, b: Port, mbit: float) -> None:
        with IPRoute(netns=a.ns) as ipa:
            # created with its peer already in b's namespace: nothing is left in the root one
            ipa.link("add", ifname=a.ifname, kind="veth", peer={"ifname": b.ifname, "net_ns_fd": b.ns})
        for port in (a, b):
            with IPRoute(netns=port.ns) as ip:
                idx = ip.link_lookup(ifname=port.ifname)[0]
                ip.link("set", index=idx, mtu=self.spec.mtu, state="up")
                ip.addr("add", index=idx, address=port.ip, prefixlen=30)
                ip.tc("add", "tbf", index=idx, rate=f"{mbit * 1e6:.0f}bit", burst=self.shaping.burst_bytes,
                      limit=self.shaping.queue_bytes)
        self.links.append((a, b))

    def _sysctls(self) -> None:
        _allow_congestion_control("cubic")
        for node in self.nodes():
            values: dict[str, int | str] = {"net/ipv4/conf/all/rp_filter": 0, "net/ipv4/conf/default/rp_filter": 0}
            if node.startswith(("leaf", "spine")):
                values["net/ipv4/ip_forward"] = 1
            else:  # a host
                values["net/ipv4/tcp_congestion_control"] = "cubic"
            if node.startswith("leaf"):
                values.update({"net/ipv4/fib_multipath_hash_policy": 3,
                               "net/ipv4/fib_multipath_hash_fields": HASH_FIELDS_5TUPLE,
                               "net/ipv4/fib_multipath_hash_seed": self.seed})
            _sysctl(self.ns(node), values)
            with IPRoute(netns=self.ns(node)) as ip:
                ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")

    def _routes(self) -> None:
        s = self.spec
        for host in s.hosts():
            with IPRoute(netns=self.ns(host)) as ip:
                ip.route("add", dst="0.0.0.0/0", gateway=s.host_gateway_ip(host))
        for leaf in range(s.leaves):
            with IPRoute(netns=self.ns(s.leaf_name(leaf))) as ip:
                hops = [{"gateway": s.uplink_ips(leaf, j)[1], "oif": ip.link_lookup(ifname=f"s{j}")[0]}
                        for j in range(s.spines)]
                for other in range(s.leaves):
                    if other != leaf:
                        ip.route("add", dst=s.leaf_prefix(other), multipath=hops)
        for spine in range(s.spines):
            with IPRoute(netns=self.ns(s.spine_name(spine))) as ip:
                for leaf in range(s.leaves):
                    ip.route("add", dst=s.leaf_prefix(leaf), gateway=s.uplink_ips(leaf, spine)[0])

    MGMT_NET = "172.30"
    MGMT_ROOT_IP = "172.30.255.254"

    def mgmt_ip(self, host: str) -> str:
        leaf, idx = self.spec.locate(host)
        return f"{self.MGMT_NET}.{leaf}.{idx + 2}"

    @property
    def mgmt_root_ifname(self) -> str:
        return f"kvm{self.run_id}"[:15]

    def _mgmt(self) -> None:
        mns = f"{self.prefix}-mgmt"
        netns.create(mns)
        with IPRoute(netns=mns) as ip:
            ip.link("add", ifname="br0", kind="bridge")
            br = ip.link_lookup(ifname="br0")[0]
            ip.link("set", index=br, state="up")
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
        ends: list[tuple[str, str, str]] = [(h, self.ns(h), self.mgmt_ip(h)) for h in self.spec.hosts()]
        for i, (host, ns, addr) in enumerate(ends):
            with IPRoute(netns=mns) as ip:
                ip.link("add", ifname=f"p{i}", kind="veth", peer={"ifname": "mgmt0", "net_ns_fd": ns})
                ip.link("set", index=ip.link_lookup(ifname=f"p{i}")[0], master=br, state="up")
            with IPRoute(netns=ns) as ip:
                idx = ip.link_lookup(ifname="mgmt0")[0]
                ip.link("set", index=idx, state="up")
                ip.addr("add", index=idx, address=addr, prefixlen=16)
        # the root namespace's end: deleting <prefix>-mgmt deletes it too (veth pairs die together)
        with IPRoute(netns=mns) as ip:
            ip.link("add", ifname="root", kind="veth",
                    peer={"ifname": self.mgmt_root_ifname, "net_ns_pid": os.getpid()})
            ip.link("set", index=ip.link_lookup(ifname="root")[0], master=br, state="up")
        with IPRoute() as ip:
            idx = ip.link_lookup(ifname=self.mgmt_root_ifname)
            if not idx:
                raise FabricBuildError("management veth not found in the root namespace")
            ip.link("set", index=idx[0], state="up")
            ip.addr("add", index=idx[0], address=self.MGMT_ROOT_IP, prefixlen=16)

    # -- use -----------------------------------------------------------------------------
    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def ports(self) -> Iterator[Port]:
        for a, b in self.links:
            yield a
            yield b


NFT_FLOW_COUNTERS = """
table inet kvpath {
  set flows {
    type ipv4_addr . ipv4_addr . inet_proto . inet_service . inet_service
    flags dynamic
    counter
    size 262144
  }
  chain kvp_forward {
    type filter hook forward priority 0; policy accept;
    meta l4proto { tcp, udp } update @flows { ip saddr . ip daddr . meta l4proto . th sport . th dport }
  }
}
"""


def nft(ns: str, ruleset: str) -> None:
    """Load an nftables ruleset inside namespace ``ns``."""
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=ruleset, text=True,
                       capture_output=True)
    if r.returncode != 0:
        raise FabricBuildError(f"nft in {ns} failed: {r.stderr.strip()} (is nftables installed? scripts/setup.sh installs it)")


def _sysctl(ns: str, values: dict[str, int | str]) -> None:
    """Write sysctls inside a namespace (/proc/sys/net follows the writer's namespace)."""
    pushns(ns)
    try:
        for key, v in values.items():
            with open(f"/proc/sys/{key}", "w") as f:
                f.write(str(v))
    finally:
        popns()


def _allow_congestion_control(name: str) -> None:
    """A namespace may only pick a congestion control from the machine-wide allowed list
    (here "reno bbr" by default); adding one to it is global and harmless."""
    path = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
    with open(path) as f:
        allowed = f.read().split()
    if name not in allowed:
        with open(path, "w") as f:
            f.write(" ".join(allowed + [name]))


def down(prefix: str = PREFIX) -> int:
    """Delete every namespace whose name starts with ``prefix`` (default: every kvpath
    testbed namespace, of any run); kill what still runs in them first. Returns how many."""
    names = [n for n in netns.listnetns() if n == prefix or n.startswith(prefix + "-")]
    for n in names:
        pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for n in names:
        try:
            netns.remove(n)
        except OSError as e:
            logger.warning("could not remove namespace %s: %s", n, e)
    return len(names)


def leftovers(prefix: str = PREFIX) -> list[str]:
    return [n for n in netns.listnetns() if n == prefix or n.startswith(prefix + "-")]


def netns_problem() -> str | None:
    """Why this machine cannot build a fabric (not root, no ``ip``/``nft``, namespaces refused),
    in one line; None when it can. Creates and removes one namespace to find out."""
    import shutil
    import uuid

    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/setup.sh installs nftables)"
    name = f"{PREFIX}-check-{uuid.uuid4().hex[:6]}"  # kvp-*: `kvpath testbed down` removes a leftover
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot create a network namespace here: {r.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
