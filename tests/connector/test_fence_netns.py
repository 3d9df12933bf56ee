"""Safety: no WRITE ever lands in a block after it was freed (real NIXL, two processes).

D runs in its own network namespace behind a veth pair shaped by tbf to 4 Mbit/s,
so a 4 MB push lasts about 8 s, far longer than D's wait bounds (1-1.5 s). As soon
as D reports a request's blocks free it writes a canary byte into all of them (as
vLLM would reuse them); the canary must still be intact seconds later, while D
keeps progressing. P's source bytes never take the canary's value, and P rewrites
its source blocks with it as soon as it frees them: D must never see it.
"""

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from kvpath.connector.config import KVPathConfig
from kvpath.testbed.peer_process import BufferSpec, PeerProcess
from kvpath.testbed.veth_peer import veth_peer

SPEC = BufferSpec(regions=2, num_blocks=48, block_len=64 * 1024, block_size=16)
CANARY = 0xCD
BLOCKS = list(range(32))  # 32 x 2 x 64 KB = 4 MB: ~8 s at 4 Mbit/s
NS = f"kvpt-fence-{os.getpid()}"
VP, VD = f"kvpf{os.getpid() % 100000}p", f"kvpf{os.getpid() % 100000}d"
P_IP, D_IP = "10.213.7.1", "10.213.7.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def slow_link():
    if os.geteuid() != 0 or not shutil.which("tc"):
        pytest.skip("needs root and iproute2's tc to build and reshape a network namespace's link")
    from pyroute2 import netns

    try:  # namespaces at all (a container may refuse them)
        netns.create(NS)
        netns.remove(NS)
    except OSError as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    # P -> D is where the KV flows: shape P's end (a deep queue: 2 s of bytes in flight)
    with veth_peer(NS, VP, VD, P_IP, D_IP, rate_mbit=4, burst_bytes=64 * 1024, queue_s=2.0):
        yield


def configs(port, keys):
    p = KVPathConfig(lanes=1, side_channel_host=P_IP, side_channel_port=port, lease_timeout_s=30.0,
                     transfer_timeout_s=2.0, ucx_net_devices=VP, **keys)
    # D: liveness 1 s, P must post within 1.5 s
    d = dataclasses.replace(p, ucx_net_devices=VD, registration_timeout_s=1.0, max_wait_s=1.5, fence_grace_s=0.3)
    return p, d


def check_canary(d, rid):
    time.sleep(4.0)  # D keeps progressing its UCX worker: a late WRITE would land now
    _, since, seen = d.call("released_at")
    assert seen[rid] == 0, "P's reused source bytes reached D: P freed them while a WRITE was in flight"
    for region in d.call("read", BLOCKS)[1]:
        arr = np.frombuffer(region, dtype=np.uint8)
        assert (arr == CANARY).all(), f"{int((arr != CANARY).sum())} bytes written into freed blocks"


@contextlib.contextmanager
def prefill_and_decode(port, keys, **d_knobs):
    """P in this namespace, D behind the shaped link, and a small push first: the
    lane opens and works through the link. Yields (P, D, P's side-channel address)."""
    p_cfg, d_cfg = configs(port, keys)
    d_cfg = dataclasses.replace(d_cfg, **d_knobs)
    addr = p_cfg.side_channel_addr()
    with PeerProcess(p_cfg, SPEC, role="prefill", max_byte=CANARY) as p, \
            PeerProcess(d_cfg, SPEC, netns=NS, canary=CANARY) as d:
        d.call("register", "d0", "warm", addr, [40], 0)
        p.call("submit", "p0", "warm", [41])
        assert d.call("wait", ["d0"], 20)[1] == ["d0"]
        yield p, d, addr


def test_a_write_that_outlasts_ds_wait_is_waited_for_not_overwritten(slow_link, cluster_keys):
    with prefill_and_decode(6950, cluster_keys) as (p, d, addr):
        t0 = time.monotonic()
        d.call("register", "d1", "slow", addr, BLOCKS, 0)
        p.call("submit", "p1", "slow", BLOCKS)
        _, done, failed = d.call("wait", ["d1"], 30)
        elapsed = time.monotonic() - t0
        # D gave up at 1.5 s (Cancel) but P had posted: the blocks stay D's until
        # the WRITE ends, and the KV that arrived is used
        assert done == ["d1"] and failed == [], (done, failed)
        assert elapsed > 3.0, f"released after {elapsed:.1f}s: the 4 MB push cannot have finished"
        assert d.call("stats")[1]["recv_timeout"] == 1
        check_canary(d, "d1")
        st = p.call("stats")[1]
        assert st["pushes_ok"] == 2 and st["pushes_slow"] == 1, st


def test_a_prefill_killed_mid_write_frees_ds_blocks_only_after_its_bytes_drained(slow_link, cluster_keys):
    with prefill_and_decode(6960, cluster_keys) as (p, d, addr):
        d.call("register", "d1", "doomed", addr, BLOCKS, 0)
        p.call("submit", "p1", "doomed", BLOCKS)
        time.sleep(1.0)  # the WRITE is moving; the link's queue holds up to 2 s of it
        p.kill()
        t_kill = time.monotonic()
        _, done, failed = d.call("wait", ["d1"], 30)
        assert done == ["d1"] and failed == ["d1"], "a dead P's push fails, and the request ends"
        since_kill = time.monotonic() - t_kill - d.call("released_at")[1]["d1"]
        st = d.call("stats")[1]
        assert st["fence_drain_releases"] == 1, st
        check_canary(d, "d1")
    assert since_kill < 25, since_kill


def test_a_prefill_restarted_on_its_address_mid_write_cannot_shortcut_the_fence(slow_link, cluster_keys):
    # The new P answers D's Cancel with "cancelled, never posted" for a transfer it never
    # saw; D must weigh that by P's instance and still wait for the old P's bytes to drain.
    # D gives up about 4 s after registering (P silent) and re-sends its Cancel for 4 s more:
    # the new P, up a few seconds after the kill, hears one
    with prefill_and_decode(6970, cluster_keys, registration_timeout_s=4.0, max_wait_s=6.0) as (p, d, addr):
        p_cfg, _ = configs(6970, cluster_keys)
        # 100 kbit/s: the killed P's bytes already queued (TCP small queues let about 256 KB in)
        # take about 20 s to drain, far longer than the new P takes to start
        sh("tc", "qdisc", "change", "dev", VP, "root", "tbf", "rate", "100kbit", "burst", "64kb", "latency", "60s")
        d.call("register", "d1", "doomed", addr, BLOCKS, 0)
        p.call("submit", "p1", "doomed", BLOCKS)
        time.sleep(1.0)  # the WRITE is moving
        p.kill()
        with PeerProcess(p_cfg, SPEC, role="prefill", max_byte=CANARY) as p2:  # same address, new process
            _, done, failed = d.call("wait", ["d1"], 90)
            assert done == ["d1"] and failed == ["d1"], "a dead P's push fails, and the request ends"
            st = d.call("stats")[1]
            # the new process's "cancelled, never posted" was heard and ignored; the release
            # came from the drain of the old process's lanes
            assert st["acks_ignored"] >= 1 and st["fence_drain_releases"] == 1, st
            check_canary(d, "d1")
            sh("tc", "qdisc", "change", "dev", VP, "root", "tbf", "rate", "4mbit", "burst", "64kb", "latency", "2s")
            # and the restarted P serves D
            d.call("register", "d2", "after", addr, [44], 0)
            p2.call("submit", "p2", "after", [45])
            _, done, failed = d.call("wait", ["d2"], 20)
            assert done == ["d2"] and not failed


@pytest.fixture
def nat_on_ps_side(slow_link):
    """SNAT on P's end of the link: P's lanes reach D from source ports P never sees
    (P's Welcome names its own 5-tuples, which D's socket table never shows)."""
    if not shutil.which("nft"):
        pytest.skip("needs nftables (nft) to rewrite P's source ports")
    table = f"kvpt_nat_{os.getpid()}"
    sh("nft", "add", "table", "ip", table)
    try:
        sh("nft", "add", "chain", "ip", table, "post", "{ type nat hook postrouting priority srcnat; }")
        sh("nft", "add", "rule", "ip", table, "post", "oifname", VP, "ip", "protocol", "tcp",
           "snat", "to", f"{P_IP}:61000-61999")
        yield
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True)


def test_a_silent_p_on_a_lane_d_was_never_told_of_is_fenced_until_the_bound(nat_on_ps_side, cluster_keys):
    """Issue 32, finding 2, on real parts: P posts a 4 MB WRITE on a lane whose 5-tuple D
    was never told (NAT rewrote it: the same state as a reopened lane whose Welcome was
    lost), then goes silent (SIGSTOP: its kernel still sends what its socket holds). The
    announced 5-tuples are not in D's socket table, so the old check called them drained
    and freed the blocks while P's bytes were still on the link. D must count the open
    connection nobody announced as "cannot tell" and wait for the documented bound
    (send + max_wait_s + transfer_timeout_s + fence_grace_s); the canary stays intact."""
    bound_s = 1.5 + 10.0 + 0.3
    with prefill_and_decode(6980, cluster_keys, transfer_timeout_s=10.0) as (p, d, addr):
        t0 = time.monotonic()
        d.call("register", "d1", "unseen-lane", addr, BLOCKS, 0)
        p.call("submit", "p1", "unseen-lane", BLOCKS)
        time.sleep(1.0)  # the WRITE is moving
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            _, done, failed = d.call("wait", ["d1"], 40)
            released_after = time.monotonic() - t0 - d.call("released_at")[1]["d1"]
            assert done == ["d1"] and failed == ["d1"], "a silent P's push fails, and the request ends"
            st = d.call("stats")[1]
            assert st["fence_bound_releases"] == 1 and st["fence_drain_releases"] == 0, st
            assert released_after >= bound_s - 0.5, f"released {released_after:.1f}s after the registration"
            check_canary(d, "d1")
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
