"""What the demo runs: its variants (a reservation mode with a placement policy) and its
two profiles (the full one and ``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One way of serving the workload: the reservation mode and the proxy's policy for
    picking P and D instances (``kvpath.proxy.instances.POLICIES``)."""

    label: str
    mode: str
    policy: str


# ecmp: every push on its hash's lane; cc: the least-loaded path; cc+lo: the same with
# least outstanding requests, not round robin; cc+joint: P, D and the lane placed together
# by predicted TTFT (docs/placement.md)
VARIANTS = (Variant("ecmp", "ecmp", "round_robin"), Variant("cc", "cc", "round_robin"),
            Variant("cc+lo", "cc", "least_outstanding"), Variant("cc+joint", "cc", "joint"))


@dataclass(frozen=True)
class Profile:
    """The workload and the fabric. ``ns3``: replay in the packet-level backend too (it
    takes longer than the flow model). Times are testbed time: links at the spec's rate / B,
    KV bytes / S (docs/testbed-emulated.md)."""

    name: str
    fabric: str
    pools: str
    requests: int
    qps: float
    max_output: int
    scale_b: float
    scale_s: float
    ns3: bool
    workload: str = "zipf"
    seed: int = 0
    variants: tuple[Variant, ...] = VARIANTS


# rack4 with 4 P and 4 D hosts at 10 QPS: the spines are contended (ecmp's FCT slowdown p99
# is 2-3x, cc's about 1.3-1.4x) while the 2-core machine keeps up (16 engines at 20 QPS
# saturated it: CPU idle 0%, every run INVALID)
FULL = Profile("full", fabric="rack4", pools="4P4D", requests=300, qps=10.0, max_output=16, scale_b=1000.0,
               scale_s=250.0, ns3=True)
QUICK = Profile("quick", fabric="small", pools="2P2D", requests=40, qps=8.0, max_output=8, scale_b=500.0,
                scale_s=250.0, ns3=False)
PROFILES = {p.name: p for p in (FULL, QUICK)}
