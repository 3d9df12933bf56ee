"""One network namespace behind one veth pair: a peer on its own link, for benchmarks
and tests that need a real link to shape (tbf) or firewall (nftables) without a whole
fabric (:mod:`kvpath.testbed.netns_fabric` builds that).

The host end stays in the root namespace; the other end, with ``lo``, is inside the
namespace. Made with pyroute2 like the fabric; teardown always runs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

from pyroute2 import IPRoute, netns

from kvpath.testbed.netns_fabric import nft

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VethPeer:
    ns: str  # the namespace
    host_if: str  # the root namespace's end
    ns_if: str  # the namespace's end
    host_ip: str
    ns_ip: str


@contextlib.contextmanager
def veth_peer(ns: str, host_if: str, ns_if: str, host_ip: str, ns_ip: str, *, prefixlen: int = 30,
              rate_mbit: float | None = None, burst_bytes: int = 64 * 1024, queue_s: float = 2.0,
              nft_rules: str | None = None) -> Iterator[VethPeer]:
    """Make namespace ``ns`` reached over a veth pair, yield it, remove both.

    ``rate_mbit``: shape the host end (the root namespace to the peer) with tbf at that
    rate, its queue holding ``queue_s`` of bytes. ``nft_rules``: an nftables ruleset
    loaded inside the namespace (a firewall in front of the peer)."""
    netns.create(ns)
    try:
        with IPRoute() as ip:
            ip.link("add", ifname=host_if, kind="veth", peer={"ifname": ns_if, "net_ns_fd": ns})
            idx = ip.link_lookup(ifname=host_if)[0]
            ip.addr("add", index=idx, address=host_ip, prefixlen=prefixlen)
            ip.link("set", index=idx, state="up")
            if rate_mbit is not None:
                rate = rate_mbit * 1e6 / 8  # bytes/s
                ip.tc("add", "tbf", index=idx, rate=f"{rate_mbit * 1e6:.0f}bit", burst=burst_bytes,
                      limit=int(rate * queue_s) + burst_bytes)
        with IPRoute(netns=ns) as ip:
            idx = ip.link_lookup(ifname=ns_if)[0]
            ip.addr("add", index=idx, address=ns_ip, prefixlen=prefixlen)
            ip.link("set", index=idx, state="up")
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
        if nft_rules:
            nft(ns, nft_rules)
        yield VethPeer(ns, host_if, ns_if, host_ip, ns_ip)
    finally:
        with contextlib.suppress(Exception), IPRoute() as ip:
            found = ip.link_lookup(ifname=host_if)
            if found:
                ip.link("del", index=found[0])  # takes its peer with it
        with contextlib.suppress(Exception):
            netns.remove(ns)
