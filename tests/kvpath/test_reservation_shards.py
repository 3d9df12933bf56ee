"""Reservation services sharded by groups of leaves (kvpath/reservation/shards.py): each
pair goes to the service of its group, a pair across groups is not reserved, releases and
updates reach the service that holds the lease."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from kvpath.fabric import FabricSpec
from kvpath.reservation import wire
from kvpath.reservation.app import create_app
from kvpath.reservation.clients import HttpReserver
from kvpath.reservation.decisions import LaneInfo, ReservationService
from kvpath.reservation.shards import ShardedReserver, ShardError, parse_shard
from kvpath.testbed.readiness import free_port
from kvpath.testbed.stub_engine import ServerThread

SPEC = FabricSpec(leaves=4, spines=2, hosts_per_leaf=2)
TOKEN = "sh4rd-t0ken"
LANES = [LaneInfo(i, 40000 + 3 * i) for i in range(4)]


@pytest.mark.parametrize("text,needle", [("0-x=http://a", "FIRST-LAST=URL"), ("0-1", "the URL must follow"),
                                         ("0-1=ftp://a", "http://"), ("2-9=http://a", "within 0-3"),
                                         ("3-2=http://a", "within 0-3")])
def test_a_bad_shard_is_refused_naming_the_option(text, needle):
    with pytest.raises(ShardError, match="--reservation-shard") as e:
        parse_shard(text, SPEC)
    assert needle in str(e.value)


def test_a_leaf_in_two_shards_is_refused():
    with pytest.raises(ShardError, match="leaf 1 is in two shards"):
        ShardedReserver(SPEC, [(range(0, 2), HttpReserver("http://a")), (range(1, 3), HttpReserver("http://b"))])


def test_each_pair_goes_to_its_groups_service_and_a_cross_group_pair_to_none():
    svcs = [ReservationService(SPEC, "cc", lease_s=60) for _ in range(2)]
    inside = [("l0h0", "l1h0"), ("l2h0", "l3h1")]  # a pair under each group's leaves
    for svc, (s, d) in zip(svcs, inside):
        svc.register_lanes(s, d, LANES)
    servers = [ServerThread(create_app(svc, token=TOKEN), free_port()) for svc in svcs]

    async def go() -> dict:
        res = ShardedReserver(SPEC, [(parse_shard(f"{lo}-{lo + 1}={srv.url}", SPEC)[0],
                                      HttpReserver(srv.url, timeout_s=10, token=TOKEN))
                                     for lo, srv in zip((0, 2), servers)])
        a = await res.reserve(*inside[0], 10**6, transfer_id="ta")
        b = await res.reserve(*inside[1], 10**6, transfer_id="tb")
        cross = await res.reserve("l1h0", "l2h0", 10**6, transfer_id="tx")
        live = [len(svc.active) for svc in svcs]
        updated = await res.update(b.lease_id, 5 * 10**6)
        unknown = await res.update("r9-nope", 1)
        await res.release(a.lease_id)
        await res.release(b.lease_id)
        await res.release("r9-nope")  # never granted: no call
        await res.close()  # sends the releases
        return {"a": a, "b": b, "cross": cross, "live": live, "updated": updated, "unknown": unknown}

    with servers[0], servers[1]:
        got = asyncio.run(go())
    assert got["a"].lane is not None and got["b"].lane is not None
    assert got["live"] == [1, 1]  # one each: each in its group's service
    assert got["cross"] == wire.LaneGrant(fallback="cross_shard")
    assert got["updated"] and not got["unknown"]
    assert [svc.counters["releases"] for svc in svcs] == [1, 1]
    assert [svc.counters.get("releases_unknown", 0) for svc in svcs] == [0, 0]
    assert all(not svc.active for svc in svcs)


def test_the_proxy_takes_shards_instead_of_one_service():
    base = [sys.executable, "-m", "kvpath.cli", "proxy", "--prefill", "http://p,kv_addr=127.0.0.1:1", "--decode",
            "http://d"]
    env = {**os.environ, wire.TOKEN_ENV: TOKEN}
    for extra, needle in ((["--reservation-shard", "0-1=http://a", "--reservation-url", "http://b"],
                           "instead of --reservation-url"),
                          (["--reservation-shard", "0-9=http://a"], "within 0-3")):
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode != 0 and needle in r.stderr, r.stderr
