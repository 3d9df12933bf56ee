"""The ns3 backend on the real ns-3 (the PyPI wheel, the scenario compiled on first use):
the analytic checks of issue 8, the per-flow spine pinning, and the serving simulation
on top of it. Flows are kept small so the whole file runs in seconds once compiled."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.workloads import load_workload
from kvpath.bridge.flow_model import FlowModel, FlowSpec, NetParams
from kvpath.bridge.ns3_backend import Ns3Backend, Ns3Error, Ns3Params, auto_min_rto_ms, ns3_root
from kvpath.bridge.serving_sim import ServingConfig, simulate

try:
    ns3_root()
except Ns3Error as e:  # pragma: no cover - the setup script installs it
    pytest.skip(f"ns3 wheel not installed: {e}", allow_module_level=True)

# 10 Gbit/s links keep packet counts (and so run time) small; 5 MB is over 100 BDPs here
SPEC = dataclasses.replace(FabricSpec.resolve("rack4"), host_link_gbps=10.0, spine_link_gbps=10.0)
H = SPEC.hosts()
MB = 5_000_000
WIRE = MB * 8 / 10e9  # size / rate


def run(flows: list[FlowSpec], **kw) -> np.ndarray:
    res = Ns3Backend(SPEC, params=Ns3Params(**kw)).run(flows)
    assert res.drops == 0  # the default queues keep these cases lossless
    return res.fct_s


def test_lone_flow_takes_size_over_rate_plus_a_small_overhead():
    fct = run([FlowSpec(H[0], H[4], MB, 0.0, 0)])
    assert WIRE <= fct[0] <= 1.05 * WIRE


def test_two_flows_on_one_spine_take_twice_as_long_and_split_do_not_meet():
    same = run([FlowSpec(H[0], H[4], MB, 0.0, 1), FlowSpec(H[1], H[5], MB, 0.0, 1)])
    split = run([FlowSpec(H[0], H[4], MB, 0.0, 1), FlowSpec(H[1], H[5], MB, 0.0, 2)])
    assert same.max() == pytest.approx(2 * WIRE, rel=0.06)
    assert split == pytest.approx([WIRE, WIRE], rel=0.05)


def test_every_flow_ends_after_its_start_plus_size_over_rate():
    rng = np.random.default_rng(3)
    flows = [FlowSpec(H[int(rng.integers(0, 8))], H[8 + int(rng.integers(0, 8))], int(rng.integers(1, 20) * 100_000),
                      float(rng.uniform(0, 0.01)), int(rng.integers(0, 4))) for _ in range(40)]
    fct = run(flows)
    wire = np.array([f.bytes * 8 / 10e9 for f in flows])
    assert (fct >= wire).all()
    # and the flow model, given the same flows, agrees on the aggregate
    flow = FlowModel(SPEC).run(flows)
    assert fct.mean() == pytest.approx(flow.mean(), rel=0.15)


def test_each_flow_crosses_exactly_the_spine_it_is_given():
    # leaf 0 -> leaf 2 on spines 0, 2, 3; nothing on spine 1. ACKs come back the same way.
    flows = [FlowSpec(H[0], H[8], MB, 0.0, 0), FlowSpec(H[1], H[9], MB, 0.0, 2), FlowSpec(H[2], H[10], MB, 0.0, 3)]
    res = Ns3Backend(SPEC).run(flows)
    up = res.uplink_bytes
    for s in (0, 2, 3):
        assert up[(0, s)] >= MB  # the data, headers included
        assert 0 < up[(2, s)] < MB // 10  # the ACKs
    assert (0, 1) not in up and (2, 1) not in up
    assert not any(leaf in (1, 3) for leaf, _ in up)


def test_within_a_leaf_and_to_itself():
    fct = Ns3Backend(SPEC, NetParams(overhead_s=0.001)).run(
        [FlowSpec(H[0], H[1], MB, 0.0), FlowSpec(H[2], H[2], MB, 0.0)]).fct_s
    assert fct[0] == pytest.approx(WIRE + 0.001, rel=0.05)
    assert fct[1] == pytest.approx(0.001)  # nothing crosses a link: the overhead alone


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="give its spine"):
        Ns3Backend(SPEC).run([FlowSpec(H[0], H[8], MB, 0.0, None)])
    with pytest.raises(ValueError, match="mtu"):
        Ns3Params(mtu=100)


def test_a_queue_past_a_queue_discs_32_bits_is_refused():
    with pytest.raises(ValueError, match="below 4 GiB"):
        Ns3Params(queue_bytes=1 << 32)


def test_a_flow_that_cannot_finish_is_reported_not_hung():
    # a 1 s horizon of simulated time and 2 GB at 10 Gbit/s: it cannot finish
    with pytest.raises(Ns3Error, match="did not finish"):
        Ns3Backend(SPEC, params=Ns3Params(horizon_s=0.01, mtu=65535)).run([FlowSpec(H[0], H[8], 2_000_000_000, 0.0, 0)])


def test_serving_simulation_on_ns3_keeps_decisions_and_causality():
    itm = IterationTimeModel.preset("llama-3-8b", "h100")
    w = load_workload("zipf", n=60, qps=30, seed=1, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    out = {}
    for backend in ("flow", "ns3"):
        cfg = ServingConfig(mode="cc", backend=backend, scale_s=100)
        trace, info = simulate(SPEC, list(w.requests), cfg, itm)
        out[backend] = trace
        if backend == "ns3":
            assert info["ns3_drops"] == 0
    flow, ns3 = out["flow"], out["ns3"]
    # the lanes are decided once, on the flow model's clock, and ns-3 replays them
    assert [q.lane for q in flow.requests] == [q.lane for q in ns3.requests]
    for q in ns3.requests:
        assert q.decode_start_s >= q.push_end_s  # decode never starts before its KV arrived
        assert q.push_end_s - q.push_start_s >= q.kv_bytes * 8 / 10e9


def test_coarse_segments_on_a_slow_link_do_not_retransmit_spuriously():
    # 64 KB segments at 0.2 Gbit/s take 2.6 ms per hop: with a fixed 5 ms RTO floor ns-3
    # retransmitted without loss (5.9x line rate); the automatic floor sits above the RTT
    slow = dataclasses.replace(SPEC, host_link_gbps=0.2, spine_link_gbps=0.2)
    h = slow.hosts()
    fct = Ns3Backend(slow, params=Ns3Params(mtu=65535)).run([FlowSpec(h[0], h[8], MB, 0.0, 0)]).fct_s
    assert fct[0] == pytest.approx(MB * 8 / 0.2e9, rel=0.10)


def test_drops_are_counted_where_queues_overflow():
    # two flows through one 64 KiB port buffer with 8 MiB windows must lose packets, and
    # the run must say so (a counter on the wrong queue once reported 0 here)
    flows = [FlowSpec(H[0], H[4], MB, 0.0, 1), FlowSpec(H[1], H[5], MB, 0.0, 1)]
    res = Ns3Backend(SPEC, params=Ns3Params(queue_bytes=64 << 10, buf_bytes=8 << 20)).run(flows)
    assert res.drops > 0
    assert res.fct_s.max() > 2 * WIRE  # the losses cost time
    # where: leaf 0's uplink to spine 1, which both flows cross; no other tier
    assert res.tier_drops == {"host_up": 0, "leaf_down": 0, "leaf_up": res.drops, "spine_down": 0}


def test_a_senders_own_port_does_not_drop_unless_asked_to():
    # one host, three flows on three spines, 64 KiB port buffers and 8 MiB windows: the
    # host's port is their only bottleneck. The testbed (Linux's TCP small queues) did
    # not drop there on any suite run; ns-3's TCP sends whole windows into it
    flows = [FlowSpec(H[0], H[4], MB, 0.0, 0), FlowSpec(H[0], H[8], MB, 0.0, 1), FlowSpec(H[0], H[12], MB, 0.0, 2)]
    res = Ns3Backend(SPEC, params=Ns3Params(queue_bytes=64 << 10, buf_bytes=8 << 20)).run(flows)
    assert res.drops == 0 and res.tier_drops["host_up"] == 0
    assert res.fct_s.max() < 1.2 * res.fct_s.min()  # and they share the port evenly
    assert res.fct_s.max() < 3.3 * WIRE
    # the port at queue_bytes (served in turn or first come, first served): it drops
    for fair, burst in ((True, 0), (False, 0), (True, 32 << 10)):  # the bucket's child queue's drops count too
        res = Ns3Backend(SPEC, NetParams(burst_bytes=burst), Ns3Params(queue_bytes=64 << 10, buf_bytes=8 << 20,
                                                                       lossless_host=False, fair_host=fair)).run(flows)
        assert res.drops == res.tier_drops["host_up"] > 0


def test_a_senders_port_serves_its_connections_in_turn_unless_asked_not_to():
    # two 5 MB pushes from one host on different spines: its own port is all they share
    flows = [FlowSpec(H[0], H[4], MB, 0.0, 0, conn=0), FlowSpec(H[0], H[5], MB, 0.001, 1, conn=1)]
    for fair, burst in ((True, 0), (False, 0), (True, 64 << 10)):  # with a bucket the fair queue is its child
        fct = Ns3Backend(SPEC, NetParams(burst_bytes=burst), Ns3Params(fair_host=fair)).run(flows).fct_s
        end = fct + [0.0, 0.001]
        assert end.max() == pytest.approx(2 * WIRE, rel=0.06)  # the port busy throughout either way
        # in turn, as Linux's small queues interleave a host's sockets: the first push has
        # the port alone for 1 ms, then half of it, so it ends 1 ms + 2 x (WIRE - 1 ms) in
        shared = 0.001 + 2 * (WIRE - 0.001)
        if fair:
            assert end[0] == pytest.approx(shared, rel=0.05)
        else:  # first come, first served: the first push's window is ahead of the second's
            assert end[0] < 0.9 * shared


def test_a_window_cut_to_one_segment_grows_again():
    # four flows into one host over four spines, 20 KiB port buffers: losses, and an RTO
    # that cuts a window to one segment. With ns-3's delayed ACK (200 ms, every second
    # segment) above the RTO floor (5 ms here) that flow then sent every segment twice,
    # the second after an RTO, and ended at 694 x its wire time
    flows = [FlowSpec(H[4 + k], H[0], MB, 0.0, k) for k in range(4)]
    res = Ns3Backend(SPEC, params=Ns3Params(queue_bytes=20 << 10, buf_bytes=8 << 20)).run(flows)
    assert res.drops > 0 and res.tier_drops["leaf_down"] > 0  # the receiver's port
    assert res.fct_s.max() < 10 * WIRE  # four flows on one 10 Gbit/s port: 4 x WIRE without losses


BURST = 1 << 20  # a token bucket of 1 MiB per port


def bucket(flows: list[FlowSpec], burst: int = BURST, **kw) -> Ns3Backend:
    return Ns3Backend(SPEC, NetParams(burst_bytes=burst), Ns3Params(**kw))


def test_a_token_bucket_lets_the_burst_through_at_once():
    # a lone flow on idle ports: its first BURST bytes leave at line speed (100x), the
    # rest at the link rate, so it ends in (size - burst) / rate, as the testbed's tbf does
    fct = bucket([]).run([FlowSpec(H[0], H[4], MB, 0.0, 0)]).fct_s
    want = (MB - BURST) * 8 / 10e9
    assert fct[0] == pytest.approx(want, rel=0.05)
    assert fct[0] < 0.9 * WIRE  # without the bucket it takes WIRE: the burst is modelled


def test_a_bucket_spent_by_one_flow_is_not_there_for_the_next():
    # two flows back to back on one path share one bucket: together they take
    # (2 size - burst) / rate, not 2 (size - burst) / rate
    a = FlowSpec(H[0], H[4], MB, 0.0, 0)
    b = FlowSpec(H[0], H[4], MB, (MB - BURST) * 8 / 10e9, 0)  # starts as the first ends
    fct = bucket([]).run([a, b]).fct_s
    assert b.start_s + fct[1] == pytest.approx((2 * MB - BURST) * 8 / 10e9, rel=0.03)


def test_a_bucket_refills_while_its_port_is_idle():
    # the second flow starts long after the first (the bucket is full again): both alone
    gap = 10 * WIRE
    fct = bucket([]).run([FlowSpec(H[0], H[4], MB, 0.0, 0), FlowSpec(H[0], H[4], MB, gap, 0)]).fct_s
    assert fct == pytest.approx([(MB - BURST) * 8 / 10e9] * 2, rel=0.05)


def test_a_bucket_smaller_than_a_packet_is_an_error():
    with pytest.raises(ValueError, match="exceed the ns3 MTU"):
        bucket([], burst=SPEC.mtu).run([FlowSpec(H[0], H[4], MB, 0.0, 0)])


def test_drops_behind_a_bucket_are_counted():
    flows = [FlowSpec(H[0], H[4], MB, 0.0, 1), FlowSpec(H[1], H[5], MB, 0.0, 1)]
    res = bucket([], burst=64 << 10, queue_bytes=64 << 10, buf_bytes=8 << 20).run(flows)
    assert res.drops > 0


def test_flows_on_one_connection_go_one_after_another_in_start_order():
    """A lane's pushes share its TCP stream: a small flow that starts behind a big one on
    the same connection lands after it (its FCT holds the wait), on its own connection
    it finishes long before; and one connection's two back-to-back flows take the time
    of their bytes at the link's rate, as one flow would, not two flows' slow starts."""
    big, small = FlowSpec(H[0], H[4], MB, 0.0, 0, conn=7), FlowSpec(H[0], H[4], 50_000, 0.0001, 0, conn=7)
    shared = run([big, small])
    own = run([dataclasses.replace(big, conn=None), dataclasses.replace(small, conn=None)])
    assert shared[1] + 0.0001 >= shared[0] - 1e-9  # the small one ends with (not before) the big one
    assert own[1] < 0.5 * own[0]  # alone on its connection, it shares the link and is done early
    # both on one connection: all the bytes at the link's rate
    assert shared[1] + 0.0001 == pytest.approx((MB + 50_000) * 8 / 10e9, rel=0.06)
    # the same conn id on another host pair is another connection
    other = run([big, dataclasses.replace(small, src=H[1], dst=H[5])])
    assert other[1] < 0.5 * other[0]


def test_a_later_flow_on_a_connection_takes_turns_with_an_earlier_one_that_fits_its_buffer():
    """A lane's WRITEs interleave (UCX sends them in fragments), so a push that starts
    while an earlier one on its lane has bytes left slows that one down, even when the
    earlier one fits the socket's buffer: the sender keeps under a turn's bytes unsent
    in the socket, not the whole flow (which would leave the later one no turn)."""
    first = FlowSpec(H[0], H[4], 900_000, 0.0, 0, conn=5)  # fits the 1 MiB buffer
    wire = first.bytes * 8 / 10e9
    second = FlowSpec(H[0], H[4], 900_000, 0.3 * wire, 0, conn=5)
    alone = run([first])[0]
    both = run([first, second])
    assert alone == pytest.approx(wire, rel=0.1)
    # the second's start to the first's end: the first's ~0.7 left plus about as many of
    # the second's bytes; queued whole, the first would end at its alone time
    assert both[0] > alone + 0.4 * wire
    assert both[1] + second.start_s >= both[0] - 1e-9  # still done in start order
    assert both[1] + second.start_s == pytest.approx(2 * wire, rel=0.08)  # the link kept busy


def test_lanes_that_lose_packets_still_write_every_flow_in_turns():
    """Two lanes, three overlapping pushes each, through one leaf uplink with a 64 KiB
    buffer: packets drop and TCP retransmits (which moves its next byte to send back),
    and every push still ends, each lane's in start order: the writer's turns wait on
    the socket's unsent bytes, and losses must not leave a turn waiting for good."""
    flows = [FlowSpec(H[h], H[4 + h], MB, 0.0002 * k, 0, conn=h) for h in (0, 1) for k in range(3)]
    res = Ns3Backend(SPEC, params=Ns3Params(queue_bytes=64 << 10, buf_bytes=8 << 20, lossless_host=False)).run(flows)
    assert res.drops > 0
    assert np.isfinite(res.fct_s).all() and (res.fct_s > 0).all()
    ends = np.array([f.start_s for f in flows]) + res.fct_s
    for lane in (slice(0, 3), slice(3, 6)):
        assert (np.diff(ends[lane]) >= -1e-9).all()
    assert ends.max() >= 6 * MB * 8 / 10e9  # all the bytes through the one uplink


def test_a_flow_after_its_connection_went_idle_is_not_held_by_rto_backoffs():
    """ns-3's TCP held new data on a connection idle for longer than its RTO for about
    five back-offs (0.94 s for 280 KB at 0.2 Gbit/s): such a flow opens a new connection;
    one after a shorter idle reuses it. A, then B overlapping A, then C after an idle
    longer than the RTO, all on one lane: B ends with A, C is not held."""
    slow = dataclasses.replace(SPEC, host_link_gbps=0.2, spine_link_gbps=0.2)
    h = slow.hosts()
    wire = 280_000 * 8 / 0.2e9
    rto = auto_min_rto_ms(slow, slow.mtu, Ns3Params().delay_us) / 1000
    for gap in (0.5 * rto, 2 * rto, 1.0):  # after the first flow's end (about 1.1 wire)
        a, b = FlowSpec(h[0], h[4], 280_000, 0.0, 0, conn=3), FlowSpec(h[0], h[4], 280_000, 1.1 * wire + gap, 0, conn=3)
        fct = Ns3Backend(slow).run([a, b]).fct_s
        assert fct[1] == pytest.approx(fct[0], rel=0.01) and fct[1] < 1.2 * wire
    a = FlowSpec(h[0], h[4], 280_000, 0.0, 0, conn=3)
    b = dataclasses.replace(a, start_s=0.2 * wire)
    c = dataclasses.replace(a, start_s=0.5)
    fct = Ns3Backend(slow).run([a, b, c]).fct_s
    # B waited on the lane: it ends after A, with both flows' bytes through the link
    assert fct[1] + b.start_s >= fct[0] - 1e-9 and fct[1] + b.start_s >= 1.9 * wire
    assert fct[2] < 1.2 * wire


def test_a_bad_conn_field_or_an_empty_flow_is_refused_by_the_scenario(tmp_path):
    from kvpath.bridge.ns3_backend import binary

    for line, msg in (("0 0 4 0 1000 0.0 x", "bad flow line"), ("0 0 4 0 1000 0.0 7abc", "bad flow line"),
                      ("0 0 4 0 1000 0.0 1 2", "bad flow line"), ("0 0 4 0 0 0.0 1", "has no bytes")):
        (tmp_path / "f.txt").write_text(line + "\n")
        r = subprocess.run([str(binary()), f"--flows={tmp_path / 'f.txt'}", f"--out={tmp_path / 'o.txt'}"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_a_new_connection_behind_a_full_port_is_not_lost_to_duplicate_syns():
    """A lane's flow after an idle opens a new connection while two other hosts keep its
    leaf's uplink queue full (1 MB at 50 Mbit/s: 168 ms). With a 10 ms SYN timeout the
    SYN went again and again; ns-3's listener forked a socket per copy and the connection
    never had its data acknowledged: its flows never finished. The SYN now waits out the
    queueing, and every flow finishes (with the 10 ms timeout: 2 flows never did)."""
    slow = dataclasses.replace(SPEC, host_link_gbps=0.05, spine_link_gbps=0.05)
    h = slow.hosts()
    big = [FlowSpec(h[i], h[4 + i], 10_000_000, 0.0, 0) for i in (0, 1)]  # both through leaf0's uplink 0
    lane = [FlowSpec(h[2], h[6], 100_000, t, 0, conn=5) for t in (0.0, 1.0, 1.05)]  # 1.0: after an idle
    res = Ns3Backend(slow, params=Ns3Params(queue_bytes=1 << 20)).run(big + lane)
    assert res.drops > 0 and res.tier_drops["leaf_up"] > 0  # the uplink's queue was full
    assert np.isfinite(res.fct_s).all() and (res.fct_s > 0).all()


def test_a_cached_binary_whose_libraries_were_deleted_is_rebuilt_and_pruned(tmp_path, monkeypatch):
    """The binary finds ns-3's libraries by the path it was linked against. A cache shared by
    checkouts once handed one checkout a binary linked against another's deleted venv, which
    then failed to start (exit 127, libns3...so not found). The path is now in the key, and
    binaries whose libraries are gone are deleted, as is what a killed compile left."""
    from kvpath.bridge import ns3_backend

    real = ns3_backend.ns3_root()
    other = tmp_path / "other-venv" / "ns3"  # a second install of the same wheel, then deleted
    (other / "lib64").mkdir(parents=True)
    (other / "include").symlink_to(real / "include")
    for so in (real / "lib64").iterdir():
        (other / "lib64" / so.name).symlink_to(so)
    cache = tmp_path / "cache"
    monkeypatch.setattr(ns3_backend, "ns3_root", lambda: other)
    stale = ns3_backend.binary(cache)
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "other-venv")
    old = cache / "kvflows-ns3.0-0000000000000000"  # built before sidecars: deleted only a day on
    young = cache / "kvflows-ns3.0-1111111111111111"
    for f in (old, young):
        f.write_text("built before the sidecar")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    killed = cache / "kvflows-ns3.0-3333333333333333.tmp"  # a compile killed two hours ago: deleted
    compiling = cache / "kvflows-ns3.0-4444444444444444.tmp"  # a compile under way: kept
    for f in (killed, compiling):
        f.write_text("half a binary")
    os.utime(killed, (time.time() - 7200,) * 2)
    (cache / "kvflows-ns3.0-2222222222222222.lib").mkdir()  # not a sidecar it can read: left as it is

    exe = ns3_backend.binary(cache)
    assert exe != stale and not stale.exists()
    assert sorted(p.name for p in cache.glob("kvflows-*")) == sorted(
        [exe.name, exe.name + ns3_backend.LIB_SUFFIX, young.name, "kvflows-ns3.0-2222222222222222.lib",
         compiling.name])
    (tmp_path / "f.txt").write_text("0 0 4 0 0 0.0 1\n")
    r = subprocess.run([str(exe), f"--flows={tmp_path / 'f.txt'}", f"--out={tmp_path / 'o.txt'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "has no bytes" in r.stderr, r.stderr  # it started and read the file
