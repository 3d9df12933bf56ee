"""The simulator family's formats both ways, Parquet, and ``kvpath bridge convert``."""

from __future__ import annotations

import argparse
import json
import math

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvpath.fabric import FabricSpec
from kvpath.trace import FiveTuple, FlowRecord, Header, Trace, TraceError, TraceWriter, read_trace
from kvpath.trace.formats import (FlowInput, from_fct_txt, from_hpcc_flows, from_request_metrics_csv, from_simai_csv,
                                  src_port_for, to_fct_txt, to_hpcc_flows, to_request_metrics_csv,
                                  to_simai_csv)
from kvpath.trace.parquet import parquet_paths, read_parquet, to_parquet
from tests.kvpath.records import FT0, FT1, flow_record, request_record
from kvpath.bridge.cli import add_parsers as add_bridge_parsers
from kvpath.bridge.convert import guess_format

SPEC = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2)  # = the "small" preset
# host order: l0h0 10.0.2.1 = 0, l0h1 10.0.3.1 = 1, l1h0 10.1.2.1 = 2, l1h1 10.1.3.1 = 3


def _trace() -> Trace:
    reqs = [request_record(), request_record(request_id="r1", status="http 503", p_instance=None, d_instance=None, prefill_start_s=None,
                         prefill_end_s=None, kv_bytes=None, push_start_s=None, push_end_s=None, lane=None,
                         five_tuple=None, path_predicted=None, path_measured=None, decode_start_s=None,
                         first_token_s=None, completion_s=None, ttft_s=None, tpot_s=None, recomputed=True)]
    flows = [flow_record(flow_id="f1", request_id=None, five_tuple=FT1, bytes=7, start_s=0.7, end_s=0.75, path=None,
                   standalone_fct_s=None), flow_record()]  # out of start order on purpose
    return Trace(Header(t0_unix=1.7e9, mode="cc", fabric=SPEC.to_dict(), meta={"seed": 3}), reqs, flows)


def _jsonl(tmp_path, trace: Trace, name: str = "t.jsonl"):
    p = tmp_path / name
    with TraceWriter(p, trace.header) as w:
        w.write_all(trace.requests)
        w.write_all(trace.flows)
    return p


# ---- SimAI -----------------------------------------------------------------------------------
def test_simai_out_and_back_maps_node_ids_by_the_specs_host_order(tmp_path):
    p = tmp_path / "flows.csv"
    assert to_simai_csv(_trace(), p, SPEC) == 2
    assert p.read_text().splitlines() == ["timestamp_ns,src_node_id,dst_node_id,size_bytes",
                                          "600000000,0,3,1000", "700000000,1,2,7"]
    back = from_simai_csv(p, SPEC)
    assert back == [FlowInput(five_tuple=FiveTuple("10.0.2.1", "10.1.3.1", 10000, 5600), bytes=1000, start_s=0.6),
                    FlowInput(five_tuple=FiveTuple("10.0.3.1", "10.1.2.1", 10001, 5600), bytes=7, start_s=0.7)]
    q = tmp_path / "again.csv"
    to_simai_csv(back, q, SPEC)
    assert q.read_text() == p.read_text()


def test_simai_reads_columns_by_name_and_wraps_source_ports(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("size_bytes,timestamp_ns,dst_node_id,src_node_id\n5,1,0,3\n\n6,2,1,2\n")
    back = from_simai_csv(p, SPEC)
    assert [(f.five_tuple, f.bytes, f.start_s) for f in back] == [
        (FiveTuple("10.1.3.1", "10.0.2.1", 10000, 5600), 5, 1e-9),
        (FiveTuple("10.1.2.1", "10.0.3.1", 10001, 5600), 6, 2e-9)]
    assert (src_port_for(55535), src_port_for(55536), src_port_for(55537)) == (65535, 10000, 10001)


def test_an_ip_outside_the_given_fabric_is_named(tmp_path):
    t = _trace()
    t.flows[0] = flow_record(flow_id="fx", five_tuple=FiveTuple("10.0.2.1", "10.7.2.1", 1, 2))
    with pytest.raises(TraceError, match=r"flow 'fx': five_tuple.dst_ip 10.7.2.1 is not a host"):
        to_simai_csv(t, tmp_path / "x.csv", SPEC)


# ---- HPCC ---------------------------------------------------------------------------------------
def test_hpcc_writes_the_count_then_src_dst_pg_dport_size_start(tmp_path):
    p = tmp_path / "flows.hpcc"
    assert to_hpcc_flows(_trace(), p) == 2  # the header's fabric maps the node ids
    assert p.read_text().splitlines() == ["2", "0 3 3 5600 1000 0.600000000", "1 2 3 5601 7 0.700000000"]
    back = from_hpcc_flows(p, SPEC)
    assert [(f.five_tuple, f.bytes, f.start_s, f.priority) for f in back] == [
        (FiveTuple("10.0.2.1", "10.1.3.1", 10000, 5600), 1000, 0.6, 3),
        (FiveTuple("10.0.3.1", "10.1.2.1", 10001, 5601), 7, 0.7, 3)]
    q = tmp_path / "again.hpcc"
    to_hpcc_flows(back, q, SPEC)
    assert q.read_text() == p.read_text()


# ---- fct.txt ----------------------------------------------------------------------------------------
def test_fct_txt_round_trip_keeps_tuples_sizes_and_times(tmp_path):
    p = tmp_path / "fct.txt"
    to_fct_txt(_trace(), p)
    assert p.read_text().splitlines() == ["0a000201 0a010301 41000 5600 1000 600000000 10000000 5000000",
                                          "0a000301 0a010201 41001 5601 7 700000000 50000000 50000000"]
    back = from_fct_txt(p)
    assert [(f.five_tuple, f.bytes) for f in back] == [(FT0, 1000), (FT1, 7)]
    for f, want in zip(back, (flow_record(), _trace().flows[0])):
        assert f.start_s == pytest.approx(want.start_s, abs=1e-9) and f.end_s == pytest.approx(want.end_s, abs=1e-9)
    assert back[0].standalone_fct_s == pytest.approx(0.005) and back[1].standalone_fct_s == pytest.approx(0.05)
    q = tmp_path / "again.fct"
    to_fct_txt(back, q)
    assert q.read_text() == p.read_text()
    with pytest.raises(TraceError, match=r"flow 'f6': five_tuple.dst_ip: fct.txt holds IPv4 addresses only"):
        to_fct_txt([flow_record(flow_id="f6", five_tuple=FiveTuple("10.0.2.1", "fd00::1", 1, 2))], q)


# ---- request_metrics.csv ----------------------------------------------------------------------------
def test_request_metrics_round_trip_keeps_times_and_tokens(tmp_path):
    p = tmp_path / "request_metrics.csv"
    assert to_request_metrics_csv(_trace(), p) == 2
    head, row0, row1 = p.read_text().splitlines()
    assert head == ("request_id,arrived_at,prefill_completed_at,decode_arrived_at,completed_at,prefill_replica_id,"
                    "decode_replica_id,pd_p2p_comm_size,pd_p2p_comm_time,request_num_prefill_tokens,"
                    "request_num_decode_tokens,ttft,tpot")
    assert row1 == "r1,0.500000000,,,,,,,,1024,8,,"
    a, b = from_request_metrics_csv(p)
    want = request_record()
    for name in ("arrival_s", "prefill_end_s", "push_start_s", "push_end_s", "first_token_s", "completion_s",
                 "ttft_s", "tpot_s"):
        assert getattr(a, name) == pytest.approx(getattr(want, name), abs=2e-9), name
    assert (a.request_id, a.prompt_tokens, a.output_tokens, a.kv_bytes, a.p_instance, a.d_instance) == (
        "r0", 1024, 8, 1000, "l0h0", "l1h1")
    assert b.request_id == "r1" and b.push_end_s is None and b.ttft_s is None and b.p_instance is None


def test_request_ids_with_commas_survive(tmp_path):
    p = tmp_path / "request_metrics.csv"
    to_request_metrics_csv([request_record(request_id="a,b")], p)
    assert from_request_metrics_csv(p)[0].request_id == "a,b"


# ---- bad input names file, line and field -------------------------------------------------------------
SIMAI_HEAD = "timestamp_ns,src_node_id,dst_node_id,size_bytes\n"
RM_HEAD = ("request_id,arrived_at,prefill_completed_at,decode_arrived_at,completed_at,prefill_replica_id,"
           "decode_replica_id,pd_p2p_comm_size,pd_p2p_comm_time,request_num_prefill_tokens,"
           "request_num_decode_tokens,ttft,tpot\n")


@pytest.mark.parametrize("reader, text, pattern", [
    ("simai", SIMAI_HEAD + "0,0,1,5\n1,0,9,5\n", r"line 3: dst_node_id: node id 9 is not a host .*ids 0\.\.3"),
    ("simai", SIMAI_HEAD + "0,0,1,5\nx,0,1,5\n", r"line 3: timestamp_ns: not an integer: 'x'"),
    ("simai", SIMAI_HEAD + "0,0,1\n", r"line 2: expected 4 fields .* got 3"),
    ("simai", "timestamp_ns,src,dst_node_id,size_bytes\n0,0,1,5\n", r"line 1: missing column\(s\) src_node_id"),
    ("simai", SIMAI_HEAD + "0,0,1,-5\n", r"line 2: size_bytes: must be in \[0, inf\]"),
    ("hpcc", "2\n0 1 3 100 5 0.1\n", r"line 1: flow count says 2 flows, the file has 1"),
    ("hpcc", "1\n0 1 3 100 5 soon\n", r"line 2: start_s: not a number: 'soon'"),
    ("hpcc", "1\n0 1 3 70000 5 0.1\n", r"line 2: dport: must be in \[0, 65535\]"),
    ("hpcc", "1\n0 1 3 100 5\n", r"line 2: expected 6 fields"),
    ("hpcc", "many\n", r"line 1: flow count: not an integer"),
    ("fct", "0a000201 0a010301 1 2 3 4 5 6\nzz000201 0a010301 1 2 3 4 5 6\n", r"line 2: sip: not an IPv4"),
    ("fct", "0a000201 0a010301 1 2 3 4 5\n", r"line 1: expected 8 fields \(sip dip"),
    ("fct", "0a000201 0a010301 1 2 3 4 -5 6\n", r"line 1: fct_ns: must be in"),
    ("rm", RM_HEAD + "r0,0.5,,,,,,,,10,2,,\nr1,0.5,,,,,,,,ten,2,,\n",
     r"line 3: request_num_prefill_tokens: not an int"),
    ("rm", RM_HEAD + "r0,0.5,,,,,,,,10,2\n", r"line 2: expected 13 fields"),
    ("rm", RM_HEAD.replace(",tpot", "") + "r0,0.5,,,,,,,,10,2,\n", r"line 1: missing column\(s\) tpot"),
    ("rm", RM_HEAD + "r0,0.5,,,0.6,,,,,10,2,0.2,\n", r"line 2: request 'r0': completion_s"),
])
def test_bad_files_name_the_line_and_field(tmp_path, reader, text, pattern):
    p = tmp_path / "in.txt"
    p.write_text(text)
    read = {"simai": lambda: from_simai_csv(p, SPEC), "hpcc": lambda: from_hpcc_flows(p, SPEC),
            "fct": lambda: from_fct_txt(p), "rm": lambda: from_request_metrics_csv(p)}[reader]
    with pytest.raises(TraceError, match=pattern) as e:
        read()
    assert str(p) in str(e.value)


# ---- Parquet ---------------------------------------------------------------------------------------------
def test_parquet_round_trip_jsonl_parquet_jsonl_is_equal(tmp_path):
    src = _jsonl(tmp_path, _trace())
    req_path, flow_path = to_parquet(read_trace(src), tmp_path / "t.parquet")
    assert (req_path.name, flow_path.name) == ("requests.parquet", "flows.parquet")
    flows = pq.read_table(flow_path)
    assert flows.column_names == ["flow_id", "request_id", "src_ip", "dst_ip", "src_port", "dst_port", "proto", "bytes",
                                  "start_s", "end_s", "path", "standalone_fct_s", "lane", "path_predicted"]
    assert json.loads(flows.schema.metadata[b"kvpath.header"])["meta"] == {"seed": 3}
    back = read_parquet(tmp_path / "t.parquet")
    assert back == read_trace(src)
    assert back.requests[1].five_tuple is None and back.requests[1].recomputed is True
    assert _jsonl(tmp_path, back, "back.jsonl").read_bytes() == src.read_bytes()


def test_a_version_1_parquet_trace_reads_as_the_current_model(tmp_path):
    """v1 flow tables lack lane and path_predicted: read as null, then taken from the request."""
    t = _trace()
    _, flow_path = to_parquet(t, tmp_path / "t.parquet")
    for path in parquet_paths(tmp_path / "t.parquet"):
        tab = pq.read_table(path)
        meta = dict(tab.schema.metadata)
        meta[b"kvpath.header"] = meta[b"kvpath.header"].replace(b'"version":2', b'"version":1')
        keep = [c for c in tab.column_names if not (path == flow_path and c in ("lane", "path_predicted"))]
        pq.write_table(tab.select(keep).replace_schema_metadata(meta), path)
    back = read_parquet(tmp_path / "t.parquet")
    assert back.header.version == 2 and back.requests == t.requests
    by_req = {q.request_id: q for q in t.requests}
    want = [(q.lane, q.path_predicted) if (q := by_req.get(f.request_id)) else (None, None) for f in t.flows]
    assert [(f.lane, f.path_predicted) for f in back.flows] == want
    assert any(f.lane is not None for f in back.flows)


def test_a_parquet_request_table_from_before_p_arrival_reads_and_a_bad_one_is_refused(tmp_path):
    t = _trace()
    req_path, _ = to_parquet(t, tmp_path / "t.parquet")
    tab = pq.read_table(req_path)
    assert tab.column("p_arrival_s").to_pylist() == [0.5, 0.5]
    pq.write_table(tab.drop_columns(["p_arrival_s"]), req_path)  # written before the field existed
    assert read_parquet(tmp_path / "t.parquet").requests == [msgspec.structs.replace(q, p_arrival_s=None)
                                                             for q in t.requests]
    arrivals = tab.column("arrival_s").to_pylist()
    for bad in ([a - 0.5 for a in arrivals], [float("nan")] * len(arrivals)):  # before the client sent it; NaN
        pq.write_table(tab.set_column(tab.column_names.index("p_arrival_s"), "p_arrival_s", pa.array(bad)), req_path)
        with pytest.raises(TraceError, match=r"requests.parquet: row 0: request .*p_arrival_s"):
            read_parquet(tmp_path / "t.parquet")


def test_parquet_paths_take_a_directory_or_a_prefix(tmp_path):
    assert parquet_paths(tmp_path / "run.parquet") == (tmp_path / "run.parquet/requests.parquet",
                                                       tmp_path / "run.parquet/flows.parquet")
    assert parquet_paths(tmp_path / "run") == (tmp_path / "run.requests.parquet", tmp_path / "run.flows.parquet")
    assert parquet_paths(tmp_path / "run.flows.parquet") == parquet_paths(tmp_path / "run")
    assert parquet_paths(tmp_path / "d/flows.parquet") == parquet_paths(f"{tmp_path}/d/") == (
        tmp_path / "d/requests.parquet", tmp_path / "d/flows.parquet")
    to_parquet(_trace(), tmp_path / "run")
    assert read_parquet(tmp_path / "run.requests.parquet") == _trace()


def test_parquet_round_trips_200k_flows(tmp_path):
    n = 200_000
    flows = [FlowRecord(flow_id=f"f{i}", request_id=f"r{i // 4}",
                        five_tuple=FiveTuple(f"10.0.{2 + i % 2}.1", f"10.1.{2 + i % 2}.1", 10000 + i % 50000, 5600),
                        bytes=1000 + i, start_s=i * 1e-3, end_s=i * 1e-3 + 0.01, path=f"spine{i % 2}",
                        standalone_fct_s=None if i % 3 else 0.004) for i in range(n)]
    t = Trace(Header(t0_unix=0.0, fabric=SPEC.to_dict()), [], flows)
    to_parquet(t, tmp_path / "big")
    back = read_parquet(tmp_path / "big")
    assert len(back.flows) == n and back == t


@pytest.mark.parametrize("which, bad, field", [
    ("flow", flow_record(end_s=0.5), "end_s"),
    ("flow", flow_record(bytes=-1), "bytes"),
    ("flow", flow_record(five_tuple=FiveTuple("10.0.2.1", "10.1.3.1", 70000, 5600)), "src_port"),
    ("flow", flow_record(five_tuple=FiveTuple("10.0.2.1", "nohost", 1, 2)), "dst_ip"),
    ("flow", flow_record(five_tuple=FiveTuple("10.0.2.1", "10.1.3.1", 1, 2, "sctp")), "proto"),
    ("flow", flow_record(standalone_fct_s=-1.0), "standalone_fct_s"),
    ("flow", flow_record(start_s=math.inf, end_s=math.inf), "start_s"),
    ("request", request_record(push_end_s=0.5), "push_end_s"),
    ("request", request_record(ttft_s=0.5), "ttft_s"),
    ("request", request_record(kv_bytes=-5), "kv_bytes"),
    ("request", request_record(prompt_tokens=-1), "prompt_tokens"),
    ("request", request_record(completion_s=0.55), "completion_s"),
    ("request", request_record(five_tuple=FiveTuple("x", "10.1.3.1", 1, 2)), "src_ip"),
    ("request", request_record(arrival_s=math.nan), "arrival_s"),
])
def test_parquet_refuses_what_validate_refuses_naming_the_row_and_field(tmp_path, which, bad, field):
    t = _trace()
    if which == "flow":
        t.flows.insert(1, bad)
    else:
        t.requests.insert(1, bad)
    with pytest.raises(TraceError, match=rf"{which}s row 1: .*{field}"):
        to_parquet(t, tmp_path / "t.parquet")


def test_read_parquet_checks_the_files_it_reads(tmp_path):
    d = tmp_path / "t.parquet"
    _, flow_path = to_parquet(_trace(), d)
    table = pq.read_table(flow_path)
    ends = table.column("end_s").to_pylist()
    ends[1] = 0.0  # before its start
    pq.write_table(table.set_column(table.column_names.index("end_s"), "end_s", pa.array(ends)), flow_path)
    with pytest.raises(TraceError, match=r"flows.parquet: row 1: flow 'f0': end_s"):
        read_parquet(d)
    pq.write_table(table.drop_columns(["bytes"]), flow_path)
    with pytest.raises(TraceError, match=r"flows.parquet: missing column bytes"):
        read_parquet(d)
    flow_path.unlink()
    with pytest.raises(TraceError, match=r"flows.parquet: no such file"):
        read_parquet(d)


# ---- kvpath bridge convert ----------------------------------------------------------------------------
def _convert(*argv: str) -> None:
    p = argparse.ArgumentParser()
    add_bridge_parsers(p.add_subparsers())
    args = p.parse_args(["bridge", "convert", *map(str, argv)])
    args.func(args)


@pytest.mark.parametrize("name, fmt", [
    ("t.jsonl", "kvpath"), ("t.parquet", "parquet"), ("fct.txt", "fct"), ("run.fct", "fct"), ("flow.txt", "hpcc"),
    ("x.hpcc", "hpcc"), ("request_metrics.csv", "request-metrics"), ("request_metrics_p.csv", "request-metrics"),
])
def test_formats_are_guessed_from_the_name(name, fmt):
    assert guess_format(name) == fmt and guess_format(name, output=True) == fmt


def test_an_input_csv_is_guessed_from_its_header(tmp_path):
    (tmp_path / "a.csv").write_text(SIMAI_HEAD)
    (tmp_path / "b.csv").write_text(RM_HEAD)
    (tmp_path / "c.csv").write_text("x,y\n")
    assert guess_format(str(tmp_path / "a.csv")) == "simai"
    assert guess_format(str(tmp_path / "b.csv")) == "request-metrics"
    assert guess_format(str(tmp_path)) == "parquet" and guess_format("out.csv", output=True) == "simai"
    with pytest.raises(ValueError, match="--from: cannot tell"):
        guess_format(str(tmp_path / "c.csv"))
    with pytest.raises(ValueError, match="--to: cannot tell the format of out.bin"):
        guess_format("out.bin", output=True)


def test_convert_moves_a_trace_through_every_format_and_back(tmp_path, capsys):
    src = _jsonl(tmp_path, _trace())
    _convert(src, tmp_path / "t.parquet")
    want = f"wrote 2 requests and 2 flows to {tmp_path / 't.parquet'} (parquet, from kvpath)\n"
    assert capsys.readouterr().out == want
    _convert(tmp_path / "t.parquet", tmp_path / "back.jsonl")
    assert (tmp_path / "back.jsonl").read_bytes() == src.read_bytes()
    _convert(src, tmp_path / "pre", "--to", "parquet")  # a prefix: pre.requests.parquet, pre.flows.parquet
    _convert(tmp_path / "pre", tmp_path / "pre.jsonl")
    assert (tmp_path / "pre.jsonl").read_bytes() == src.read_bytes()
    _convert(src, tmp_path / "flows.csv")  # the fabric: the trace header's
    assert "left out: 2 requests" in capsys.readouterr().out
    _convert(tmp_path / "flows.csv", tmp_path / "flow.txt", "--fabric", "small")
    _convert(tmp_path / "flow.txt", tmp_path / "again.csv", "--fabric", "small")
    assert (tmp_path / "again.csv").read_text() == (tmp_path / "flows.csv").read_text()
    _convert(src, tmp_path / "fct.txt")
    _convert(tmp_path / "fct.txt", tmp_path / "fromfct.jsonl", "--fabric", "small", "--json")
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (out["from"], out["to"], out["requests"], out["flows"]) == ("fct", "kvpath", 0, 2)
    t = read_trace(tmp_path / "fromfct.jsonl")
    assert t.header.fabric == SPEC.to_dict() and [f.five_tuple for f in t.flows] == [FT0, FT1]
    _convert(src, tmp_path / "request_metrics.csv")
    _convert(tmp_path / "request_metrics.csv", tmp_path / "rm.jsonl")
    assert [r.request_id for r in read_trace(tmp_path / "rm.jsonl").requests] == ["r0", "r1"]


@pytest.mark.parametrize("argv, pattern", [
    (["flow.txt", "fct.txt", "--fabric", "small"],
     r"cannot convert hpcc to fct: an fct.txt needs each flow.s end time"),
    (["flow.txt", "out.jsonl", "--fabric", "small"], r"cannot convert hpcc to kvpath: .* no end times"),
    (["flow.txt", "out.csv"], r"--fabric: reading hpcc's node ids needs the fabric"),
    (["fct.txt", "out.csv"], r"--fabric: writing simai's node ids needs the fabric"),
    (["request_metrics.csv", "flow.txt", "--fabric", "small"],
     r"cannot convert request-metrics to hpcc: an HPCC flow file holds flows; a request_metrics.csv has none"),
    (["fct.txt", "request_metrics.csv"],
     r"cannot convert fct to request-metrics: a request_metrics.csv holds requests; an fct.txt has none"),
    (["flow.txt", "out.csv", "--fabric", "huge"], r"--fabric: fabric 'huge' is neither a preset"),
    (["bad.hpcc", "out.csv", "--fabric", "small"], r"bad.hpcc: line 2: dst: node id 4 is not a host"),
    (["nothere.jsonl", "out.csv"], r"IN: no such file: .*nothere.jsonl"),
    (["nothere.csv", "out.jsonl"], r"IN: no such file: .*nothere.csv"),
    (["fct.txt", "out.bin"], r"--to: cannot tell the format"),
])
def test_convert_errors_name_what_is_missing(tmp_path, monkeypatch, argv, pattern):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flow.txt").write_text("1\n0 3 3 5600 10 0.5\n")
    (tmp_path / "bad.hpcc").write_text("1\n0 4 3 5600 10 0.5\n")
    to_fct_txt(_trace(), tmp_path / "fct.txt")
    to_request_metrics_csv(_trace(), tmp_path / "request_metrics.csv")
    with pytest.raises(SystemExit, match=rf"^kvpath bridge convert: error: {pattern}"):
        _convert(*argv)
