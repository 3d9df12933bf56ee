"""Byte counters of an emulated fabric: per link (the kernel's interface counters)
and per 5-tuple per spine (the nftables dynamic set each spine keeps), so a flow's
measured path is exact even while flows overlap."""

from __future__ import annotations

import json
import re
import subprocess

from kvpath.fabric import PORT_TIERS
from kvpath.five_tuple import FiveTuple
from kvpath.testbed.netns_fabric import NetnsFabric, Port

PROTO = {"tcp": "tcp", "udp": "udp", 6: "tcp", 17: "udp"}


def spine_flow_bytes(fabric: NetnsFabric) -> dict[FiveTuple, dict[str, int]]:
    """5-tuple -> {spine name: bytes forwarded} since the fabric was built."""
    out: dict[FiveTuple, dict[str, int]] = {}
    for j in range(fabric.spec.spines):
        spine = fabric.spec.spine_name(j)
        r = subprocess.run(["ip", "netns", "exec", fabric.ns(spine), "nft", "-j", "list", "set", "inet", "kvpath",
                            "flows"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"reading the flow counters of {spine} failed: {r.stderr.strip()}")
        for obj in json.loads(r.stdout)["nftables"]:
            for e in obj.get("set", {}).get("elem", []):
                el = e["elem"]
                sip, dip, proto, sport, dport = el["val"]["concat"]
                key = FiveTuple(sip, dip, int(sport), int(dport), PROTO.get(proto, str(proto)))
                out.setdefault(key, {})[spine] = int(el["counter"]["bytes"])
    return out


def measured_spine(counts: dict[FiveTuple, dict[str, int]], flow: FiveTuple, min_bytes: int = 1) -> str | None:
    """The spine that carried a flow's data (the one with the most bytes); None if none did."""
    per = counts.get(flow, {})
    best = max(per.items(), key=lambda kv: kv[1], default=None)
    return best[0] if best is not None and best[1] >= min_bytes else None


def _ports_by_ns(fabric: NetnsFabric) -> dict[str, list[Port]]:
    by_ns: dict[str, list[Port]] = {}
    for port in fabric.ports():
        by_ns.setdefault(port.ns, []).append(port)
    return by_ns


def link_bytes(fabric: NetnsFabric) -> dict[tuple[str, str], int]:
    """(node, interface) -> bytes sent on that end of its link."""
    # `ip -s -j link` rather than pyroute2's IPRoute(netns=...): that forks this process
    # once per namespace, and a fork of the orchestrator while vLLM engines run beside
    # it lost them their API server (seen twice in a row, never with this).
    out: dict[tuple[str, str], int] = {}
    for ns, ports in _ports_by_ns(fabric).items():
        r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"reading the link counters of {ns} failed: {r.stderr.strip()}")
        tx = {d["ifname"]: int(d.get("stats64", {}).get("tx", {}).get("bytes", 0)) for d in json.loads(r.stdout)}
        for port in ports:
            out[(port.node, port.ifname)] = tx.get(port.ifname, 0)
    return out


def port_drops(fabric: NetnsFabric) -> dict[tuple[str, str], int]:
    """(node, interface) -> packets its egress qdisc dropped (tbf over its limit: the
    port's buffer was full) since the fabric was built."""
    out: dict[tuple[str, str], int] = {}
    for ns, ports in _ports_by_ns(fabric).items():
        r = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"reading the qdisc counters of {ns} failed: {r.stderr.strip()}")
        drops: dict[str, int] = {}
        for q in json.loads(r.stdout or "[]"):
            drops[q.get("dev", "")] = drops.get(q.get("dev", ""), 0) + int(q.get("drops", 0))
        for port in ports:
            out[(port.node, port.ifname)] = drops.get(port.ifname, 0)
    return out


def port_tier(ifname: str) -> str:
    """The tier (``kvpath.fabric.PORT_TIERS``) of an egress port by its interface name:
    a host's ``eth0``, a leaf's ``h<i>`` (to a host) and ``s<j>`` (to a spine), a
    spine's ``l<k>`` (to a leaf)."""
    if ifname == "eth0":
        return "host_up"
    if not re.fullmatch(r"[hsl][0-9]+", ifname):
        raise ValueError(f"not a fabric port: {ifname!r}")
    return {"h": "leaf_down", "s": "leaf_up", "l": "spine_down"}[ifname[0]]


def drops_by_tier(port_drops: dict[str, int]) -> dict[str, int]:
    """{"node:ifname": drops} (a run's ``port_drops``) summed per tier of port."""
    out = dict.fromkeys(PORT_TIERS, 0)
    for port, n in port_drops.items():
        out[port_tier(port.rpartition(":")[2])] += n
    return out


def tcp_retransmits(fabric: NetnsFabric, hosts: list[str]) -> dict[str, int]:
    """host -> TCP segments its namespace retransmitted (``RetransSegs`` of its own
    ``/proc/net/snmp``: each network namespace keeps its own) since it was built."""
    out: dict[str, int] = {}
    for host in hosts:
        r = subprocess.run(["ip", "netns", "exec", fabric.ns(host), "cat", "/proc/net/snmp"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"reading the TCP counters of {host} failed: {r.stderr.strip()}")
        out[host] = retrans_segs(r.stdout)
    return out


def retrans_segs(snmp: str) -> int:
    """``RetransSegs`` from the text of ``/proc/net/snmp`` (a header line of names, then
    one of values, for each protocol)."""
    rows = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2 or "RetransSegs" not in rows[0]:
        raise ValueError("no Tcp RetransSegs in /proc/net/snmp")
    return int(rows[1][rows[0].index("RetransSegs")])
