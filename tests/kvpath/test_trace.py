"""The trace schema: round trip, validation naming the field, versions, exporters."""

from __future__ import annotations

import pytest

from kvpath.fabric import FabricSpec
from kvpath.trace import SCHEMA_VERSION, FiveTuple, Header, TraceError, TraceWriter, read_trace
from kvpath.trace.formats import from_fct_txt, hex_ip, to_fct_txt, to_request_metrics_csv, to_simai_csv
from tests.kvpath.records import FT0, flow_record, request_record

FT = FT0


def _write(tmp_path, recs, header=None):
    p = tmp_path / "t.jsonl"
    h = header or Header(t0_unix=1.7e9, mode="cc", fabric=FabricSpec(leaves=2, spines=2, hosts_per_leaf=2).to_dict())
    with TraceWriter(p, h) as w:
        w.write_all(recs)
    return p


def test_round_trip(tmp_path):
    p = _write(tmp_path, [request_record(), flow_record()])
    t = read_trace(p)
    assert t.header.version == SCHEMA_VERSION and t.requests == [request_record()] and t.flows == [flow_record()]
    assert t.flows_by_request()["r0"][0].fct_s == pytest.approx(0.01)


@pytest.mark.parametrize("rec, field", [
    (flow_record(end_s=0.5), "end_s"),
    (flow_record(bytes=-1), "bytes"),
    (flow_record(five_tuple=FiveTuple("10.0.2.1", "10.1.3.1", 70000, 5600)), "src_port"),
    (flow_record(five_tuple=FiveTuple("10.0.2.1", "nohost", 1, 2)), "dst_ip"),
    (flow_record(five_tuple=FiveTuple("10.0.2.1", "10.1.3.1", 1, 2, "sctp")), "proto"),
    (request_record(push_end_s=0.5), "push_end_s"),
    (request_record(ttft_s=0.5), "ttft_s"),
    (request_record(kv_bytes=-5), "kv_bytes"),
    (request_record(completion_s=0.55), "completion_s"),
    (request_record(p_arrival_s=0.0), "p_arrival_s"),  # P got it before the client sent it
    (request_record(p_arrival_s=float("nan")), "p_arrival_s"),
    (request_record(p_arrival_s=0.55), "prefill_start_s"),  # P's prefill before P's server got it
    (request_record(p_arrival_s=1e300, prefill_start_s=None), "first_token_s"),
])
def test_a_bad_record_is_refused_on_write_naming_the_field(tmp_path, rec, field):
    with pytest.raises(TraceError, match=field):
        _write(tmp_path, [rec])


def test_bad_files_are_refused_with_the_line(tmp_path):
    p = _write(tmp_path, [request_record()])
    text = p.read_text().replace(f'"version":{SCHEMA_VERSION}', '"version":7')
    p.write_text(text)
    with pytest.raises(TraceError, match="version 7"):
        read_trace(p)
    p.write_text(text.replace('"version":7', f'"version":{SCHEMA_VERSION}') + '{"type":"flow","flow_id":"x"}\n')
    with pytest.raises(TraceError, match="line 3"):
        read_trace(p)
    p.write_text("RequestRecord\n")  # not JSON
    with pytest.raises(TraceError, match="line 1"):
        read_trace(p)
    q = tmp_path / "noheader.jsonl"
    q.write_text('{"type":"request","request_id":"a","arrival_s":0,"prompt_tokens":1,"output_tokens":1}\n')
    with pytest.raises(TraceError, match="header"):
        read_trace(q)


def test_exporters_write_the_simulators_formats(tmp_path):
    t = read_trace(_write(tmp_path, [request_record(), flow_record(), flow_record(flow_id="f1", start_s=0.7, end_s=0.75,
                                                             standalone_fct_s=None, bytes=7)]))
    assert hex_ip("10.1.3.1") == "0a010301"
    to_fct_txt(t, tmp_path / "fct.txt")
    assert (tmp_path / "fct.txt").read_text().splitlines() == [
        "0a000201 0a010301 41000 5600 1000 600000000 10000000 5000000",
        "0a000201 0a010301 41000 5600 7 700000000 50000000 50000000",
    ]
    back = from_fct_txt(tmp_path / "fct.txt")
    assert back[0].five_tuple == FT and back[0].bytes == 1000 and back[0].fct_s == pytest.approx(0.01)
    to_simai_csv(t, tmp_path / "flows.csv")
    # node ids: host indices in the spec (l0h0 = 0, l0h1 = 1, l1h0 = 2, l1h1 = 3)
    assert (tmp_path / "flows.csv").read_text().splitlines() == [
        "timestamp_ns,src_node_id,dst_node_id,size_bytes", "600000000,0,3,1000", "700000000,0,3,7"]
    to_request_metrics_csv(t, tmp_path / "rm.csv")
    head, row = (tmp_path / "rm.csv").read_text().splitlines()
    assert head.startswith("request_id,arrived_at,prefill_completed_at,decode_arrived_at,completed_at,")
    assert row.split(",")[:4] == ["r0", "0.500000000", "0.600000000", "0.610000000"]


def test_standalone_fct_adds_the_fixed_cost_measured_on_lone_pushes():
    from kvpath.testbed.run_report import calibrate_standalone

    lone = [{"start": 10.0 * i, "end": 10.0 * i + 0.053, "fct": 0.053, "wire_fct": 0.050} for i in range(6)]
    # two pushes that overlap: slowed by sharing, they must not set the overhead
    both = [{"start": 100.0, "end": 100.2, "fct": 0.2, "wire_fct": 0.05}, {"start": 100.1, "end": 100.3, "fct": 0.2,
                                                                          "wire_fct": 0.05}]
    overhead, n = calibrate_standalone(lone + both)
    assert n == 6 and abs(overhead - 0.003) < 1e-9
    assert all(abs(f["slowdown"] - 1.0) < 1e-9 for f in lone)
    assert abs(both[0]["slowdown"] - 0.2 / 0.053) < 1e-9
    overhead, n = calibrate_standalone(lone[:4] + both)  # too few alone: wire time only
    assert (overhead, n) == (0.0, 4) and abs(lone[0]["slowdown"] - 0.053 / 0.05) < 1e-9


# ---- schema version 1, several flows per request ----------------------------------------
V1_TRACE = """\
{"type":"header","version":1,"t0_unix":1795344224.26,"mode":"cc","fabric":{},"scale_b":500.0,"scale_s":500.0,"link_mbit":200.0,"meta":{"pools":"1P1D"}}
{"type":"request","request_id":"r1","arrival_s":1.1178,"prompt_tokens":1026,"output_tokens":51,"status":"ok","p_instance":"l0h1","d_instance":"l1h1","prefill_start_s":1.12,"prefill_end_s":1.18,"kv_bytes":272480,"push_start_s":1.1809,"push_end_s":1.1908,"lane":2,"five_tuple":{"src_ip":"10.0.3.1","dst_ip":"10.1.3.1","src_port":60917,"dst_port":51563,"proto":"tcp"},"path_predicted":"spine1","path_measured":"spine0","decode_start_s":1.2,"first_token_s":1.25,"completion_s":1.5,"ttft_s":0.1322,"tpot_s":0.005,"recomputed":false}
{"type":"flow","flow_id":"3f0c","request_id":"r1","five_tuple":{"src_ip":"10.0.3.1","dst_ip":"10.1.3.1","src_port":60917,"dst_port":51563,"proto":"tcp"},"bytes":272480,"start_s":1.1809,"end_s":1.1908,"path":"spine0","standalone_fct_s":0.00566}
"""


def test_a_version_1_trace_reads_as_the_current_model(tmp_path):
    p = tmp_path / "v1.jsonl"
    p.write_text(V1_TRACE)
    t = read_trace(p)
    assert SCHEMA_VERSION == 2 and t.header.version == 2 and t.header.scale_b == 500.0
    (q,), (f,) = t.requests, t.flows
    # what a v1 request said stays readable where it was
    assert (q.lane, q.path_predicted, q.path_measured) == (2, "spine1", "spine0")
    assert q.five_tuple == FiveTuple("10.0.3.1", "10.1.3.1", 60917, 51563) == f.five_tuple
    # and its flow carries it too, as a v2 flow does
    assert (f.lane, f.path_predicted, f.path, f.bytes) == (2, "spine1", "spine0", 272480)
    assert t.flows_of("r1") == [f]


def test_a_request_owns_several_flows(tmp_path):
    ft2 = FiveTuple("10.0.2.1", "10.1.3.1", 41001, 5601)
    req = request_record(lane=None, five_tuple=None, path_predicted=None, path_measured=None, kv_bytes=2000)
    flows = [flow_record(lane=0, path_predicted="spine1"), flow_record(flow_id="f1", five_tuple=ft2, lane=1, path="spine0",
                                                           path_predicted="spine0")]
    t = read_trace(_write(tmp_path, [req, *flows]))
    assert t.requests == [req] and t.flows_of("r0") == flows
    assert [(f.lane, f.five_tuple, f.path) for f in t.flows_by_request()["r0"]] == [(0, FT, "spine1"),
                                                                                      (1, ft2, "spine0")]


def test_five_tuple_is_one_hashable_type_with_its_reverse():
    from kvpath.fabric import FabricSpec as F
    from kvpath.testbed import counters

    assert counters.FiveTuple is FiveTuple
    assert FT.reverse() == FiveTuple("10.1.3.1", "10.0.2.1", 5600, 41000) and FT.reverse().reverse() == FT
    assert {FT: 1}[FiveTuple("10.0.2.1", "10.1.3.1", 41000, 5600, "tcp")] == 1
    assert list(FT.to_dict()) == ["src_ip", "dst_ip", "src_port", "dst_port", "proto"]
    spec = F(leaves=2, spines=4, hosts_per_leaf=2)
    assert spec.flow_path("l0h0", "l1h0", 41000, 5600).spine == f"spine{spec.ecmp_hash(FiveTuple(spec.host_ip('l0h0'), spec.host_ip('l1h0'), 41000, 5600)) % 4}"
