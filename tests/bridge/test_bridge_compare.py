"""``kvpath bridge compare`` on a synthetic trace whose answers are known."""

import json
import subprocess
import sys

import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.trace import FiveTuple, FlowRecord, Header, Trace, TraceWriter, read_trace
from kvpath.bridge.compare import compare_fct
from kvpath.bridge.flow_model import NetParams

SPEC = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2)
RATE = 800e6 / 8  # the trace's links: 800 Mbit/s
SIZE = 10_000_000
T = SIZE / RATE


def _trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    # two pushes on spine0 from t=0 share it all the way (2T each); one alone on spine1 (T)
    flows = [("10.0.2.1", "10.1.2.1", 0.0, 2 * T, "spine0"), ("10.0.3.1", "10.1.3.1", 0.0, 2 * T, "spine0"),
             ("10.0.2.1", "10.1.3.1", 10.0, 10.0 + T, "spine1")]
    with TraceWriter(path, Header(t0_unix=0.0, mode="ecmp", fabric=SPEC.to_dict(), link_mbit=800.0)) as w:
        for i, (s, d, a, b, spine) in enumerate(flows):
            w.write(FlowRecord(flow_id=f"f{i}", request_id=None, five_tuple=FiveTuple(s, d, 40000 + i, KV_SIDE_CHANNEL_PORT),
                               bytes=SIZE, start_s=a, end_s=b, path=spine))
    return path


def test_the_flow_model_reproduces_shared_and_lone_flows_and_trivial_misses_the_sharing(tmp_path):
    errs = compare_fct(read_trace(_trace(tmp_path)), ["flow", "trivial"], NetParams())
    f, t = errs["flow"], errs["trivial"]
    assert f.n == 3 and max(abs(f.mean), abs(f.p50), abs(f.p99), abs(f.bias), f.mean_abs) < 1e-9
    assert t.p99 == pytest.approx(-0.5, rel=1e-6) and t.mean == pytest.approx(3 / 5 - 1, rel=1e-6)


def test_the_cli_prints_errors_as_json_and_names_bad_input(tmp_path):
    path = _trace(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "compare", str(path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"flow", "trivial"} and abs(out["flow"]["fct"]["p99"]) < 1e-9
    assert out["flow"]["ttft"] is None  # a flows-only trace has no requests to replay
    for args, field in ((["--backend", "ns4"], "--backend"), (["--efficiency", "0"], "efficiency")):
        r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "compare", str(path), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and field in r.stderr and "Traceback" not in r.stderr


def test_simulate_cli_prints_one_row_per_backend_and_mode(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "simulate", "--fabric", "small", "--pools", "2P2D",
                        "--requests", "40", "--qps", "20", "--mode", "ecmp,cc", "--backend", "flow,trivial", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["backend"], x["mode"]) for x in rows] == [("flow", "ecmp"), ("flow", "cc"), ("trivial", "ecmp"),
                                                         ("trivial", "cc")]
    assert all(x["requests"] == 40 and x["fct_p99_s"] >= x["fct_mean_s"] > 0 for x in rows)
    assert len(read_trace(tmp_path / "flow-cc.jsonl").flows) == 40  # written and valid
    bad = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "simulate", "--pools", "8x8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--pools" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_takes_the_links_token_bucket_and_buffer_from_the_header(tmp_path, ns3_wheel):
    import argparse

    from kvpath.bridge.cli_args import ns3_params

    # a lone 10 MB push on links with a 1 MiB token bucket ends in (size - burst) / rate
    burst = 1 << 20
    path = tmp_path / "trace.jsonl"
    header = Header(t0_unix=0.0, mode="ecmp", fabric=SPEC.to_dict(), link_mbit=800.0,
                    meta={"burst_bytes": burst, "queue_bytes": 4 << 20})
    with TraceWriter(path, header) as w:
        w.write(FlowRecord(flow_id="f0", request_id=None, five_tuple=FiveTuple("10.0.2.1", "10.1.2.1", 40000, KV_SIDE_CHANNEL_PORT),
                           bytes=SIZE, start_s=0.0, end_s=(SIZE - burst) / RATE, path="spine1"))
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "compare", str(path), "--backend", "flow,ns3",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert abs(out["flow"]["fct"]["mean"]) < 1e-9
    assert abs(out["ns3"]["fct"]["mean"]) < 0.03  # without the bucket: +12%
    args = argparse.Namespace(ns3_mtu=None, ns3_queue_bytes=None, ns3_tcp="TcpCubic")
    assert ns3_params(args, "compare", read_trace(path)).queue_bytes == 4 << 20
    assert ns3_params(args, "compare").queue_bytes == 16 << 20  # no trace: deep, lossless
    args.ns3_queue_bytes = 1 << 20  # the command line wins
    assert ns3_params(args, "compare", read_trace(path)).queue_bytes == 1 << 20


@pytest.mark.parametrize("host_mbit,spine_mbit", [(800.0, 400.0), (400.0, 800.0)],
                         ids=["spine-bottleneck", "host-bottleneck"])
def test_each_tier_runs_at_its_own_rate_in_every_backend(tmp_path, ns3_wheel, host_mbit, spine_mbit):
    """A testbed trace whose host and spine links ran at different rates (the header's
    host_link_mbit and link_mbit): a lone push across the spines ends at the slower
    tier's rate, and every backend replays it so, whichever tier is the slower. With
    one rate for both tiers (the spine's, as before) the host-bottleneck case is off by
    half."""
    import dataclasses

    from kvpath.trace.header import header_fabric

    burst = 1 << 20
    rate = min(host_mbit, spine_mbit) * 1e6 / 8
    path = tmp_path / "trace.jsonl"
    spec = dataclasses.replace(SPEC, host_link_gbps=100.0 * host_mbit / spine_mbit, spine_link_gbps=100.0)
    header = Header(t0_unix=0.0, mode="ecmp", fabric=spec.to_dict(), link_mbit=spine_mbit, host_link_mbit=host_mbit,
                    meta={"burst_bytes": burst, "queue_bytes": 4 << 20})
    assert (header_fabric(header).host_link_gbps, header_fabric(header).spine_link_gbps) == \
        pytest.approx((host_mbit / 1000, spine_mbit / 1000))
    with TraceWriter(path, header) as w:
        w.write(FlowRecord(flow_id="f0", request_id=None, five_tuple=FiveTuple("10.0.2.1", "10.1.2.1", 40000, KV_SIDE_CHANNEL_PORT),
                           bytes=SIZE, start_s=0.0, end_s=(SIZE - burst) / rate, path="spine1"))
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "bridge", "compare", str(path), "--backend",
                        "flow,trivial,ns3", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert abs(out["flow"]["fct"]["mean"]) < 1e-9 and abs(out["trivial"]["fct"]["mean"]) < 1e-9
    assert abs(out["ns3"]["fct"]["mean"]) < 0.05
    # drops side by side: the trace recorded none here; ns-3 counts its own, the flow model none
    assert out["ns3"]["drops"] == {"measured": None, "simulated": 0}
    assert out["flow"]["drops"] == {"measured": None, "simulated": None}


def test_the_first_flow_on_each_five_tuple_by_start_time_is_the_cold_one():
    from kvpath.bridge.compare import first_on_connection, trace_flows

    def flow(i, sport, start):
        return FlowRecord(flow_id=f"f{i}", request_id=f"r{i}", five_tuple=FiveTuple("10.0.0.1", "10.1.0.1", sport, 5000),
                          bytes=1000, start_s=start, end_s=start + 0.01, path="spine0")

    # written out of start order: the later flow on port 41000 comes first in the file
    t = Trace(Header(t0_unix=0.0, fabric=SPEC.to_dict()), [], [flow(0, 41000, 2.0), flow(1, 41000, 1.0), flow(2, 41001, 3.0)])
    assert first_on_connection(t) == [False, True, True]
    assert [f.cold for f in trace_flows(t)[0]] == [False, True, True]


def test_flows_of_one_five_tuple_share_a_connection_number():
    from kvpath.bridge.compare import connections, trace_flows

    def flow(i, sport):
        return FlowRecord(flow_id=f"f{i}", request_id=f"r{i}", five_tuple=FiveTuple("10.0.0.1", "10.1.0.1", sport, 5000),
                          bytes=1000, start_s=float(i), end_s=i + 0.01, path="spine0")

    flows = [flow(0, 41000), flow(1, 41001), flow(2, 41000)]
    t = Trace(Header(t0_unix=0.0, fabric=SPEC.to_dict(), link_mbit=800.0), [], flows)  # a testbed run's
    assert connections(t) == [0, 1, 0]
    assert [f.conn for f in trace_flows(t)[0]] == [0, 1, 0]
    simulated = Trace(Header(t0_unix=0.0, fabric=SPEC.to_dict()), [], flows)  # the serving simulation's: one each
    assert [f.conn for f in trace_flows(simulated)[0]] == [None] * 3
