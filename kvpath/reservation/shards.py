"""Reservation services sharded by groups of leaves (``kvpath proxy --reservation-shard``).

In a leaf-spine fabric a flow between two hosts under leaves of one group uses only
links of those leaves (host links, and the links between those leaves and the spines),
so it shares no link with a flow inside another group. One service per group then
decides every flow inside its group exactly as one service for the whole fabric would
(``tests/kvpath/test_reservation.py``), and no service holds more than its group's
lanes. A flow across groups shares links with both: no one shard sees them all, so it
is not reserved (the connector takes the hash's lane, counted as ``cross_shard``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvpath.fabric import FabricSpec, FabricSpecError
from kvpath.reservation import wire
from kvpath.reservation.clients import HttpReserver
from kvpath.reservation.wire import FlowScope, LaneGrant, LaneInfo

MAX_TRACKED_LEASES = 1 << 20  # lease id -> its shard, for release and update (the oldest forgotten past it)


class ShardError(ValueError):
    """A shard spec that does not fit the fabric (its message names the option)."""


def parse_shard(text: str, spec: FabricSpec) -> tuple[range, str]:
    """``FIRST-LAST=URL`` (or ``LEAF=URL``): the leaves a service decides for, and its URL."""
    leaves, sep, url = text.partition("=")
    first, _, last = leaves.partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ShardError(f"--reservation-shard {text!r}: give the leaves as FIRST-LAST=URL, e.g. 0-7=http://svc:9100")
    if not sep or not url.startswith(("http://", "https://")):
        raise ShardError(f"--reservation-shard {text!r}: the URL must follow '=' and start with http:// or https://")
    if not 0 <= lo <= hi < spec.leaves:
        raise ShardError(f"--reservation-shard {text!r}: leaves must be within 0-{spec.leaves - 1} of the fabric")
    return range(lo, hi + 1), url


class ShardedReserver:
    """An :class:`~kvpath.reservation.wire.AsyncReserver` over one ``HttpReserver`` per
    group of leaves. A pair whose hosts are under one group goes to that group's service;
    any other pair is a ``cross_shard`` fallback (nothing reserved). A placement goes to a
    shard when every engine it may choose is under that shard's leaves, else the caller
    picks as without one (``cross_shard``)."""

    def __init__(self, spec: FabricSpec, shards: Sequence[tuple[range, HttpReserver]]):
        if not shards:
            raise ShardError("--reservation-shard: give at least one")
        self.spec = spec
        self.shards = [r for _, r in shards]
        self._of_leaf: list[int | None] = [None] * spec.leaves
        for k, (leaves, _) in enumerate(shards):
            for leaf in leaves:
                if self._of_leaf[leaf] is not None:
                    raise ShardError(f"--reservation-shard: leaf {leaf} is in two shards")
                self._of_leaf[leaf] = k
        self._lease_shard: OrderedDict[str, int] = OrderedDict()

    def _shard(self, *hosts: str) -> int | None:
        """The one shard every host is under, else None."""
        got = set()
        for h in hosts:
            try:
                got.add(self._of_leaf[self.spec.locate(h)[0]])
            except FabricSpecError:
                return None
        return got.pop() if len(got) == 1 else None

    def _track(self, lease_id: str | None, k: int) -> None:
        if lease_id:
            self._lease_shard[lease_id] = k
            if len(self._lease_shard) > MAX_TRACKED_LEASES:
                self._lease_shard.popitem(last=False)  # its lease ends it

    async def reserve(self, src_host: str, dst_host: str, nbytes: int, lanes: Sequence[LaneInfo] | None = None,
                      transfer_id: str = "", scope: FlowScope | None = None) -> LaneGrant:
        k = self._shard(src_host, dst_host)
        if k is None:
            return LaneGrant(fallback="cross_shard")
        grant = await self.shards[k].reserve(src_host, dst_host, nbytes, lanes, transfer_id, scope)
        self._track(grant.lease_id, k)
        return grant

    async def release(self, lease_id: str) -> None:
        k = self._lease_shard.pop(lease_id, None)
        if k is not None:
            await self.shards[k].release(lease_id)

    async def update(self, lease_id: str, nbytes: int, expected_end_s: float | None = None) -> bool:
        k = self._lease_shard.get(lease_id)
        return k is not None and await self.shards[k].update(lease_id, nbytes, expected_end_s)

    async def place(self, req: wire.PlaceRequest) -> wire.PlaceAnswer | str:
        k = self._shard(*(e.host for e in (*req.prefill, *req.decode)))
        if k is None:
            return "cross_shard"
        ans = await self.shards[k].place(req)
        if not isinstance(ans, str):
            self._track(ans.lease_id, k)
        return ans

    async def close(self) -> None:
        for r in self.shards:
            await r.close()
