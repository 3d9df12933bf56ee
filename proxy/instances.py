"""Engine instances (P and D pools) and the routing policies that pick them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

# round robin and least outstanding pick each pool alone; joint and network ask the
# reservation service for P, D and the lane together (docs/placement.md), least
# outstanding when it cannot
POLICIES = ("round_robin", "least_outstanding", "joint", "network")
PLACED_POLICIES = ("joint", "network")


MAX_INSTANCES = 4096  # per pool: /admin/instances cannot grow it without end


class PoolFull(ValueError):
    """The pool holds MAX_INSTANCES already."""


class NoInstance(RuntimeError):
    pass


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    fabric_host: str = ""  # host in the fabric spec (reservations)
    kv_addr: str = ""  # P only: connector side channel (push) or NIXL side channel (inproc-push), host:port
    # the engine's kv_transfer_config.engine_id: which registered worker pairs carry a
    # reservation (push), the NIXL peer to read from (P, inproc-push)
    engine_id: str = ""
    # P only, push: its TP size, sent to D. 0: not known yet; the proxy learns it from P's
    # own answer (its kv_transfer_params name it), sending P's leg before D's until then
    tp_size: int = 0
    tp_learned: bool = False  # tp_size came from P's answers, not from the operator
    tp_unnamed_warned: bool = field(default=False, compare=False)  # said once: P's answers name no TP size
    inflight: int = 0
    queued_tokens: int = 0  # P: prompt tokens of its legs in flight (their prefills are queued or computing)
    served: int = 0
    errors: int = 0
    healthy: bool = True  # False: out of rotation (proxy/health.py)
    health_failures: int = 0  # failed probes (or leg connections) in a row
    added_seq: int = field(default=0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "fabric_host": self.fabric_host, "kv_addr": self.kv_addr,
                "engine_id": self.engine_id, "tp_size": self.tp_size,
                "tp_source": "learned" if self.tp_learned else "given" if self.tp_size else "unknown", "inflight": self.inflight, "served": self.served, "errors": self.errors,
                "healthy": self.healthy, "health_failures": self.health_failures}


class InstancePool:
    """One role's instances. Not thread-safe: used from the proxy's event loop only."""

    def __init__(self, role: str, policy: str = "round_robin"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.role = role
        self.policy = policy
        self._items: dict[str, Instance] = {}
        self._rr = itertools.count()
        self._seq = itertools.count()

    def add(self, inst: Instance) -> bool:
        """Add, or update what the operator gives of one already here (in place: requests
        in flight hold it, and end on it); True when it is new. PoolFull: no room."""
        old = self._items.get(inst.url)
        if old is not None:
            old.fabric_host, old.kv_addr, old.engine_id = inst.fabric_host, inst.kv_addr, inst.engine_id
            old.tp_size, old.tp_learned = inst.tp_size, inst.tp_learned  # 0: learned again from P's next answer
            return False
        if len(self._items) >= MAX_INSTANCES:
            raise PoolFull(f"the {self.role} pool is full ({MAX_INSTANCES} instances): remove one first")
        inst.added_seq = next(self._seq)
        self._items[inst.url] = inst
        return True

    def get(self, url: str) -> Instance | None:
        return self._items.get(url)

    def remove(self, url: str) -> bool:
        return self._items.pop(url, None) is not None

    def all(self) -> list[Instance]:
        return sorted(self._items.values(), key=lambda i: i.added_seq)

    def healthy_count(self) -> int:
        return sum(1 for i in self._items.values() if i.healthy)

    def pick(self) -> Instance:
        """An instance in rotation (healthy), by the policy."""
        items = self.all()
        if not items:
            raise NoInstance(f"no {self.role} instance is configured")
        items = [i for i in items if i.healthy]
        if not items:
            raise NoInstance(f"every {self.role} instance is unhealthy (failing /health or unreachable); "
                             f"none is in rotation, retry later")
        n = next(self._rr)
        if self.policy == "round_robin":
            return items[n % len(items)]
        # least outstanding (and joint or network when the service could not place)
        low = min(i.inflight for i in items)
        ties = [i for i in items if i.inflight == low]
        return ties[n % len(ties)]
