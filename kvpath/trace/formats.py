"""A kvpath trace to and from the simulator family's text formats. ``docs/formats.md``
documents every column; Parquet lives in :mod:`kvpath.trace.parquet`.

- SimAI/Vidur flow trace CSV: ``timestamp_ns,src_node_id,dst_node_id,size_bytes``.
- ``fct.txt`` (HPCC style): ``sip dip sport dport size start_ns fct_ns
  standalone_fct_ns``, IPs as 8 hex digits (10.1.2.1 -> 0a010201).
- HPCC flow file: the flow count, then ``src dst pg dport size start_s`` per flow.
- ``request_metrics.csv`` of the P/D co-simulation, in seconds.

Node ids are host indices in the fabric spec's host order (``l0h0`` = 0, ``l0h1`` = 1,
... leaf by leaf). The SimAI and HPCC files say which flows to simulate, not how they
went: they hold no end times, so they read back as :class:`FlowInput`, not as
:class:`~kvpath.trace.FlowRecord`. Every reader raises :class:`TraceError` naming the
file, the line and the field.
"""

from __future__ import annotations

import csv
import ipaddress
import math
from pathlib import Path
from typing import Callable, Sequence, TypeVar, Union

import msgspec

from kvpath.fabric import FabricSpec, FabricSpecError
from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.five_tuple import FiveTuple
from kvpath.trace.records import FlowRecord, RequestRecord, Trace, TraceError, validate

SIMAI_COLUMNS = ("timestamp_ns", "src_node_id", "dst_node_id", "size_bytes")
FCT_FIELDS = ("sip", "dip", "sport", "dport", "size", "start_ns", "fct_ns", "standalone_fct_ns")
HPCC_FIELDS = ("src", "dst", "pg", "dport", "size", "start_s")
HPCC_PRIORITY = 3  # HPCC's data priority group: what its traffic generator writes
# Ports the SimAI/HPCC files do not carry: source 10000 + the flow's index (mod 55536,
# to stay a port), so imported 5-tuples differ; destination the KV side channel's port.
SRC_PORT_BASE = 10000
SRC_PORT_SPAN = 65536 - SRC_PORT_BASE
DEFAULT_DST_PORT = KV_SIDE_CHANNEL_PORT
COLUMNS = ("arrived_at", "prefill_completed_at", "decode_arrived_at", "completed_at", "prefill_replica_id",
           "decode_replica_id", "pd_p2p_comm_size", "pd_p2p_comm_time", "request_num_prefill_tokens",
           "request_num_decode_tokens", "ttft", "tpot")
REQUEST_METRICS_COLUMNS = ("request_id",) + COLUMNS


class FlowInput(msgspec.Struct, frozen=True, kw_only=True):
    """A flow to simulate, without its outcome: what a SimAI or HPCC file holds."""

    five_tuple: FiveTuple
    bytes: int
    start_s: float
    priority: int = HPCC_PRIORITY


FlowLike = Union[FlowRecord, FlowInput]
T = TypeVar("T")


def hex_ip(ip: str) -> str:
    return f"{int(ipaddress.IPv4Address(ip)):08x}"


def ip_from_hex(h: str) -> str:
    if len(h) != 8:
        raise ValueError(f"not 8 hex digits: {h!r}")
    return str(ipaddress.IPv4Address(int(h, 16)))


def _ns(s: float) -> int:
    return int(round(s * 1e9))


def src_port_for(index: int) -> int:
    """The source port given to the ``index``-th imported flow (0-based)."""
    return SRC_PORT_BASE + index % SRC_PORT_SPAN


# ---- node ids -----------------------------------------------------------------------
def _ips(flows: Sequence[FlowLike]) -> list[str]:
    return sorted({ip for f in flows for ip in (f.five_tuple.src_ip, f.five_tuple.dst_ip)},
                  key=lambda x: int(ipaddress.IPv4Address(x)))


def _strict_ids(flows: Sequence[FlowLike], spec: FabricSpec) -> dict[str, int]:
    index = {h: i for i, h in enumerate(spec.hosts())}
    ids: dict[str, int] = {}
    for n, f in enumerate(flows):
        for name in ("src_ip", "dst_ip"):
            ip = getattr(f.five_tuple, name)
            if ip not in ids:
                try:
                    ids[ip] = index[spec.canonical(ip)]
                except FabricSpecError:
                    what = f"flow {f.flow_id!r}" if isinstance(f, FlowRecord) else f"flow {n}"
                    raise TraceError(f"{what}: five_tuple.{name} {ip} is not a host of the fabric "
                                     f"({spec.leaves} leaves x {spec.hosts_per_leaf} hosts, {spec.base_net})") from None
    return ids


def node_ids(trace: Trace | Sequence[FlowLike], spec: FabricSpec | None = None) -> dict[str, int]:
    """IP -> node id. With ``spec``: the host's index in it, every IP must be one of its
    hosts. Without: the header's fabric when every IP is in it, else the sorted IPs' order
    (the testbed's exporters, which must write something)."""
    flows = trace.flows if isinstance(trace, Trace) else trace
    if spec is not None:
        return _strict_ids(flows, spec)
    if isinstance(trace, Trace) and trace.header.fabric:
        try:
            return _strict_ids(flows, FabricSpec.from_dict(trace.header.fabric))
        except (FabricSpecError, TraceError):
            pass
    return {ip: i for i, ip in enumerate(_ips(flows))}


def _node_ip(spec: FabricSpec, hosts: list[str], where: str, field: str, text: str) -> str:
    n = _int(where, field, text)
    if not 0 <= n < len(hosts):
        raise TraceError(f"{where}: {field}: node id {n} is not a host of the fabric "
                         f"(ids 0..{len(hosts) - 1}: {spec.leaves} leaves x {spec.hosts_per_leaf} hosts)")
    return spec.host_ip(hosts[n])


# ---- field parsing -------------------------------------------------------------------
def _parse(where: str, field: str, text: str, conv: Callable[[str], T], kind: str) -> T:
    try:
        return conv(text)
    except ValueError:
        raise TraceError(f"{where}: {field}: not {kind}: {text!r}") from None


def _int(where: str, field: str, text: str, lo: int = 0, hi: int | None = None) -> int:
    v = _parse(where, field, text, int, "an integer")
    if v < lo or (hi is not None and v > hi):
        raise TraceError(f"{where}: {field}: must be in [{lo}, {'inf' if hi is None else hi}], got {v}")
    return v


def _float(where: str, field: str, text: str) -> float:
    v = _parse(where, field, text, float, "a number")
    if not math.isfinite(v):
        raise TraceError(f"{where}: {field}: must be finite, got {text!r}")
    return v


def _lines(path: str | Path) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read {path}: {e}") from None


def _fields(where: str, line: str, names: Sequence[str], sep: str | None) -> list[str]:
    parts = [p.strip() for p in line.split(sep)] if sep else line.split()
    if len(parts) != len(names):
        raise TraceError(f"{where}: expected {len(names)} fields ({' '.join(names)}), got {len(parts)}")
    return parts


def _validated(where: str, rec: T) -> T:
    try:
        validate(rec)  # type: ignore[arg-type]
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None
    return rec


def _by_start(flows: Sequence[FlowLike]) -> list[FlowLike]:
    return sorted(flows, key=lambda f: f.start_s)  # simulators read flows in start order


def _flows_of(src: Trace | Sequence[FlowLike]) -> Sequence[FlowLike]:
    return src.flows if isinstance(src, Trace) else src


# ---- SimAI / Vidur flow trace ---------------------------------------------------------
def to_simai_csv(src: Trace | Sequence[FlowLike], path: str | Path, spec: FabricSpec | None = None) -> int:
    flows = _flows_of(src)
    ids = node_ids(src, spec)
    lines = [",".join(SIMAI_COLUMNS)]
    lines += [f"{_ns(f.start_s)},{ids[f.five_tuple.src_ip]},{ids[f.five_tuple.dst_ip]},{f.bytes}"
              for f in _by_start(flows)]
    Path(path).write_text("\n".join(lines) + "\n")
    return len(lines) - 1


def from_simai_csv(path: str | Path, spec: FabricSpec) -> list[FlowInput]:
    lines = _lines(path)
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}: line 1: empty file: expected the header {','.join(SIMAI_COLUMNS)}")
    head = [c.strip() for c in lines[0].split(",")]
    missing = [c for c in SIMAI_COLUMNS if c not in head]
    if missing:
        raise TraceError(f"{path}: line 1: missing column(s) {', '.join(missing)} (header: {lines[0].strip()!r})")
    col = {c: head.index(c) for c in SIMAI_COLUMNS}
    hosts = spec.hosts()
    out: list[FlowInput] = []
    for i, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        where = f"{path}: line {i}"
        parts = _fields(where, line, head, ",")
        v = {c: parts[col[c]] for c in SIMAI_COLUMNS}
        src = _node_ip(spec, hosts, where, "src_node_id", v["src_node_id"])
        dst = _node_ip(spec, hosts, where, "dst_node_id", v["dst_node_id"])
        ft = FiveTuple(src, dst, src_port_for(len(out)), DEFAULT_DST_PORT)
        out.append(FlowInput(five_tuple=ft, bytes=_int(where, "size_bytes", v["size_bytes"]),
                             start_s=_int(where, "timestamp_ns", v["timestamp_ns"]) / 1e9))
    return out


# ---- HPCC flow file ---------------------------------------------------------------------
def to_hpcc_flows(src: Trace | Sequence[FlowLike], path: str | Path, spec: FabricSpec | None = None) -> int:
    flows = _by_start(_flows_of(src))
    ids = node_ids(src, spec)
    lines = [str(len(flows))]
    lines += [f"{ids[f.five_tuple.src_ip]} {ids[f.five_tuple.dst_ip]} {getattr(f, 'priority', HPCC_PRIORITY)} "
              f"{f.five_tuple.dst_port} {f.bytes} {f.start_s:.9f}" for f in flows]
    Path(path).write_text("\n".join(lines) + "\n")
    return len(flows)


def from_hpcc_flows(path: str | Path, spec: FabricSpec) -> list[FlowInput]:
    lines = _lines(path)
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}: line 1: empty file: expected the flow count")
    count = _int(f"{path}: line 1", "flow count", lines[0].strip())
    hosts = spec.hosts()
    out: list[FlowInput] = []
    for i, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        where = f"{path}: line {i}"
        src, dst, pg, dport, size, start = _fields(where, line, HPCC_FIELDS, None)
        ft = FiveTuple(_node_ip(spec, hosts, where, "src", src), _node_ip(spec, hosts, where, "dst", dst),
                       src_port_for(len(out)), _int(where, "dport", dport, hi=65535))
        out.append(FlowInput(five_tuple=ft, bytes=_int(where, "size", size), start_s=_float(where, "start_s", start),
                             priority=_int(where, "pg", pg)))
    if count != len(out):
        raise TraceError(f"{path}: line 1: flow count says {count} flows, the file has {len(out)}")
    return out


# ---- fct.txt --------------------------------------------------------------------------------
def to_fct_txt(src: Trace | Sequence[FlowRecord], path: str | Path) -> int:
    def hx(f: FlowRecord, name: str) -> str:
        try:
            return hex_ip(getattr(f.five_tuple, name))
        except ValueError:
            raise TraceError(f"flow {f.flow_id!r}: five_tuple.{name}: fct.txt holds IPv4 addresses only, got "
                             f"{getattr(f.five_tuple, name)!r}") from None

    lines = []
    for f in _by_start(_flows_of(src)):
        t = f.five_tuple
        fct = _ns(f.fct_s)
        alone = _ns(f.standalone_fct_s) if f.standalone_fct_s is not None else fct
        lines.append(f"{hx(f, 'src_ip')} {hx(f, 'dst_ip')} {t.src_port} {t.dst_port} {f.bytes} "
                     f"{_ns(f.start_s)} {fct} {alone}")
    Path(path).write_text("".join(line + "\n" for line in lines))
    return len(lines)


def from_fct_txt(path: str | Path) -> list[FlowRecord]:
    out = []
    for i, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}: line {i}"
        sip, dip, sport, dport, size, start, fct, alone = _fields(where, line, FCT_FIELDS, None)
        ft = FiveTuple(_parse(where, "sip", sip, ip_from_hex, "an IPv4 address in 8 hex digits"),
                       _parse(where, "dip", dip, ip_from_hex, "an IPv4 address in 8 hex digits"),
                       _int(where, "sport", sport, hi=65535), _int(where, "dport", dport, hi=65535))
        start_ns = _int(where, "start_ns", start)
        rec = FlowRecord(flow_id=f"f{i}", request_id=None, five_tuple=ft, bytes=_int(where, "size", size),
                         start_s=start_ns / 1e9, end_s=(start_ns + _int(where, "fct_ns", fct)) / 1e9,
                         standalone_fct_s=_int(where, "standalone_fct_ns", alone) / 1e9)
        out.append(_validated(where, rec))
    return out


# ---- request_metrics.csv ------------------------------------------------------------------
def to_request_metrics_csv(src: Trace | Sequence[RequestRecord], path: str | Path) -> int:
    def v(x: object) -> str:
        return "" if x is None else (f"{x:.9f}" if isinstance(x, float) else str(x))

    reqs = src.requests if isinstance(src, Trace) else src
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")  # quotes an id holding a comma; plain values stay bare
        w.writerow(REQUEST_METRICS_COLUMNS)
        for r in reqs:
            comm = (r.push_end_s - r.push_start_s) if r.push_start_s is not None and r.push_end_s is not None else None
            row = (r.arrival_s, r.prefill_end_s, r.push_end_s, r.completion_s, r.p_instance, r.d_instance,
                   r.kv_bytes, comm, r.prompt_tokens, r.output_tokens, r.ttft_s, r.tpot_s)
            w.writerow([r.request_id] + [v(x) for x in row])
    return len(reqs)


def _opt(where: str, field: str, text: str, conv: Callable[[str, str, str], T]) -> T | None:
    return None if text == "" else conv(where, field, text)


def _request(where: str, v: dict[str, str]) -> RequestRecord:
    def f(column: str) -> float | None:
        return _opt(where, column, v[column], _float)

    if not v["request_id"]:
        raise TraceError(f"{where}: request_id: empty")
    arrival = _float(where, "arrived_at", v["arrived_at"])
    push_end, comm, ttft = f("decode_arrived_at"), f("pd_p2p_comm_time"), f("ttft")
    return RequestRecord(
        request_id=v["request_id"], arrival_s=arrival,
        prompt_tokens=_int(where, "request_num_prefill_tokens", v["request_num_prefill_tokens"]),
        output_tokens=_int(where, "request_num_decode_tokens", v["request_num_decode_tokens"]),
        p_instance=v["prefill_replica_id"] or None, d_instance=v["decode_replica_id"] or None,
        prefill_end_s=f("prefill_completed_at"), kv_bytes=_opt(where, "pd_p2p_comm_size", v["pd_p2p_comm_size"], _int),
        push_start_s=push_end - comm if push_end is not None and comm is not None else None, push_end_s=push_end,
        first_token_s=arrival + ttft if ttft is not None else None, completion_s=f("completed_at"),
        ttft_s=ttft, tpot_s=f("tpot"))


def from_request_metrics_csv(path: str | Path) -> list[RequestRecord]:
    """Requests back from ``to_request_metrics_csv``'s columns (by name; others ignored):
    the push's start is its end minus ``pd_p2p_comm_time``, the first token ``arrived_at +
    ttft``."""
    rows = list(csv.reader(_lines(path)))
    if not rows or not rows[0]:
        raise TraceError(f"{path}: line 1: empty file: expected the header {','.join(REQUEST_METRICS_COLUMNS)}")
    head = [c.strip() for c in rows[0]]
    missing = [c for c in REQUEST_METRICS_COLUMNS if c not in head]
    if missing:
        raise TraceError(f"{path}: line 1: missing column(s) {', '.join(missing)}")
    out = []
    for i, row in enumerate(rows[1:], 2):  # one row per line: the exporter writes no line breaks in a field
        if not any(x.strip() for x in row):
            continue
        where = f"{path}: line {i}"
        if len(row) != len(head):
            raise TraceError(f"{where}: expected {len(head)} fields (as the header), got {len(row)}")
        out.append(_validated(where, _request(where, {c: x.strip() for c, x in zip(head, row)})))
    return out
