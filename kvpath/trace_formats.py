"""Exporters from a kvpath trace to the simulator family's formats.

- SimAI/Vidur flow trace CSV: ``timestamp_ns,src_node_id,dst_node_id,size_bytes``;
  node ids are host indices in the fabric spec's host order (``l0h0`` = 0, ``l0h1``
  = 1, ...), or, without a spec in the header, the sorted order of the IPs seen.
- ``fct.txt`` (HPCC style): ``sip dip sport dport size start_ns fct_ns
  standalone_fct_ns`` with IPs as 8 hex digits (10.1.2.1 -> 0a010201) and the real
  source port; a flow without a standalone FCT gets its FCT there.
- ``request_metrics.csv`` of the P/D co-simulation: ``arrived_at,
  prefill_completed_at,decode_arrived_at,completed_at,prefill_replica_id,
  decode_replica_id,pd_p2p_comm_size,pd_p2p_comm_time,request_num_prefill_tokens,
  request_num_decode_tokens,ttft,tpot`` in seconds.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from kvpath.fabric import FabricSpec, FabricSpecError
from kvpath.trace import FiveTuple, FlowRecord, Trace, TraceError


def hex_ip(ip: str) -> str:
    return f"{int(ipaddress.IPv4Address(ip)):08x}"


def ip_from_hex(h: str) -> str:
    return str(ipaddress.IPv4Address(int(h, 16)))


def node_ids(trace: Trace) -> dict[str, int]:
    """IP -> node id: the host's index in the spec when the header has one."""
    ips = sorted({ip for f in trace.flows for ip in (f.five_tuple.src_ip, f.five_tuple.dst_ip)},
                 key=lambda x: int(ipaddress.IPv4Address(x)))
    if trace.header.fabric:
        try:
            spec = FabricSpec.from_dict(trace.header.fabric)
            index = {h: i for i, h in enumerate(spec.hosts())}
            return {ip: index[spec.canonical(ip)] for ip in ips}
        except (FabricSpecError, KeyError):
            pass
    return {ip: i for i, ip in enumerate(ips)}


def _ns(s: float) -> int:
    return int(round(s * 1e9))


def to_simai_csv(trace: Trace, path: str | Path) -> int:
    ids = node_ids(trace)
    lines = ["timestamp_ns,src_node_id,dst_node_id,size_bytes"]
    for f in sorted(trace.flows, key=lambda f: f.start_s):
        lines.append(f"{_ns(f.start_s)},{ids[f.five_tuple.src_ip]},{ids[f.five_tuple.dst_ip]},{f.bytes}")
    Path(path).write_text("\n".join(lines) + "\n")
    return len(lines) - 1


def to_fct_txt(trace: Trace, path: str | Path) -> int:
    lines = []
    for f in sorted(trace.flows, key=lambda f: f.start_s):
        t = f.five_tuple
        fct = _ns(f.fct_s)
        alone = _ns(f.standalone_fct_s) if f.standalone_fct_s is not None else fct
        lines.append(f"{hex_ip(t.src_ip)} {hex_ip(t.dst_ip)} {t.src_port} {t.dst_port} {f.bytes} "
                     f"{_ns(f.start_s)} {fct} {alone}")
    Path(path).write_text("".join(line + "\n" for line in lines))
    return len(lines)


def from_fct_txt(path: str | Path) -> list[FlowRecord]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 8:
            raise TraceError(f"{path}: line {i}: expected 8 fields (sip dip sport dport size start_ns fct_ns "
                             f"standalone_fct_ns), got {len(parts)}")
        try:
            sip, dip = ip_from_hex(parts[0]), ip_from_hex(parts[1])
            sport, dport, size, start, fct, alone = (int(x) for x in parts[2:])
        except ValueError as e:
            raise TraceError(f"{path}: line {i}: {e}") from None
        out.append(FlowRecord(flow_id=f"f{i}", request_id=None, five_tuple=FiveTuple(sip, dip, sport, dport),
                              bytes=size, start_s=start / 1e9, end_s=(start + fct) / 1e9, standalone_fct_s=alone / 1e9))
    return out


COLUMNS = ("arrived_at", "prefill_completed_at", "decode_arrived_at", "completed_at", "prefill_replica_id",
           "decode_replica_id", "pd_p2p_comm_size", "pd_p2p_comm_time", "request_num_prefill_tokens",
           "request_num_decode_tokens", "ttft", "tpot")


def to_request_metrics_csv(trace: Trace, path: str | Path) -> int:
    def v(x: object) -> str:
        return "" if x is None else (f"{x:.9f}" if isinstance(x, float) else str(x))

    lines = [",".join(("request_id",) + COLUMNS)]
    for r in trace.requests:
        comm = (r.push_end_s - r.push_start_s) if r.push_start_s is not None and r.push_end_s is not None else None
        row = (r.arrival_s, r.prefill_end_s, r.push_end_s, r.completion_s, r.p_instance, r.d_instance, r.kv_bytes,
               comm, r.prompt_tokens, r.output_tokens, r.ttft_s, r.tpot_s)
        lines.append(",".join([r.request_id] + [v(x) for x in row]))
    Path(path).write_text("\n".join(lines) + "\n")
    return len(lines) - 1
