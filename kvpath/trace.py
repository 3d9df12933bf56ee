"""The trace: one versioned schema for what a run did, written by the testbed and read
by the simulator bridge. ``docs/trace.md`` documents every field.

A trace is a JSON Lines file: a ``header`` first, then ``request`` and ``flow``
records in any order. Times are seconds since the run's start (the header's
``t0_unix``), on one clock. Every record is validated on write and on read; a bad
record raises :class:`TraceError` naming the record and the field.
"""

from __future__ import annotations

import ipaddress
import math
from pathlib import Path
from typing import Any, Iterable, Union

import msgspec

SCHEMA_VERSION = 1
EPS = 1e-6  # one microsecond: the slack for derived times


class TraceError(ValueError):
    pass


class FiveTuple(msgspec.Struct, frozen=True):
    src_ip: str
    dst_ip: str
    src_port: int
    dst_port: int
    proto: str = "tcp"


class Header(msgspec.Struct, tag="header", kw_only=True):
    version: int = SCHEMA_VERSION
    t0_unix: float  # the run's start, unix seconds: every other time is relative to it
    mode: str = ""  # ecmp | cc | dc | pull | ...
    fabric: dict[str, Any] = {}  # kvpath.fabric.FabricSpec.to_dict()
    scale_b: float = 1.0  # link rates divided by B
    scale_s: float = 1.0  # KV bytes divided by S
    link_mbit: float | None = None  # the testbed's link rate
    meta: dict[str, Any] = {}


class RequestRecord(msgspec.Struct, tag="request", kw_only=True):
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    status: str = "ok"
    p_instance: str | None = None
    d_instance: str | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    kv_bytes: int | None = None
    push_start_s: float | None = None
    push_end_s: float | None = None
    lane: int | None = None
    five_tuple: FiveTuple | None = None
    path_predicted: str | None = None
    path_measured: str | None = None
    decode_start_s: float | None = None
    first_token_s: float | None = None
    completion_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    recomputed: bool = False


class FlowRecord(msgspec.Struct, tag="flow", kw_only=True):
    flow_id: str
    request_id: str | None
    five_tuple: FiveTuple
    bytes: int
    start_s: float
    end_s: float
    path: str | None = None  # the spine whose counters carried it; None within a leaf
    standalone_fct_s: float | None = None

    @property
    def fct_s(self) -> float:
        return self.end_s - self.start_s


Record = Union[Header, RequestRecord, FlowRecord]
_decoder = msgspec.json.Decoder(Record)
_encoder = msgspec.json.Encoder()


def _check_tuple(ft: FiveTuple, where: str) -> None:
    for name in ("src_ip", "dst_ip"):
        try:
            ipaddress.ip_address(getattr(ft, name))
        except ValueError:
            raise TraceError(f"{where}: five_tuple.{name} is not an IP address: {getattr(ft, name)!r}") from None
    for name in ("src_port", "dst_port"):
        if not 0 <= getattr(ft, name) <= 65535:
            raise TraceError(f"{where}: five_tuple.{name} must be in [0, 65535], got {getattr(ft, name)}")
    if ft.proto not in ("tcp", "udp"):
        raise TraceError(f"{where}: five_tuple.proto must be tcp or udp, got {ft.proto!r}")


def _finite(where: str, **vals: float | None) -> None:
    for name, v in vals.items():
        if v is not None and not math.isfinite(v):
            raise TraceError(f"{where}: {name} must be a finite number, got {v!r}")


def validate(rec: Record) -> None:
    if isinstance(rec, Header):
        if rec.version != SCHEMA_VERSION:
            raise TraceError(f"header: schema version {rec.version} is not supported (this kvpath reads {SCHEMA_VERSION})")
        if rec.scale_b <= 0 or rec.scale_s <= 0:
            raise TraceError("header: scale_b and scale_s must be > 0")
        return
    if isinstance(rec, FlowRecord):
        where = f"flow {rec.flow_id!r}"
        _check_tuple(rec.five_tuple, where)
        _finite(where, start_s=rec.start_s, end_s=rec.end_s, standalone_fct_s=rec.standalone_fct_s)
        if rec.bytes < 0:
            raise TraceError(f"{where}: bytes must be >= 0, got {rec.bytes}")
        if rec.end_s < rec.start_s:
            raise TraceError(f"{where}: end_s ({rec.end_s}) is before start_s ({rec.start_s})")
        if rec.standalone_fct_s is not None and rec.standalone_fct_s < 0:
            raise TraceError(f"{where}: standalone_fct_s must be >= 0")
        return
    where = f"request {rec.request_id!r}"
    if rec.prompt_tokens < 0 or rec.output_tokens < 0:
        raise TraceError(f"{where}: prompt_tokens and output_tokens must be >= 0")
    if rec.kv_bytes is not None and rec.kv_bytes < 0:
        raise TraceError(f"{where}: kv_bytes must be >= 0, got {rec.kv_bytes}")
    if rec.five_tuple is not None:
        _check_tuple(rec.five_tuple, where)
    _finite(where, arrival_s=rec.arrival_s, ttft_s=rec.ttft_s, tpot_s=rec.tpot_s)
    for a, b in (("prefill_start_s", "prefill_end_s"), ("push_start_s", "push_end_s"),
                 ("arrival_s", "first_token_s"), ("first_token_s", "completion_s")):
        va, vb = getattr(rec, a), getattr(rec, b)
        if va is not None and vb is not None and vb + EPS < va:
            raise TraceError(f"{where}: {b} ({vb}) is before {a} ({va})")
    if rec.ttft_s is not None and rec.first_token_s is not None and abs(rec.ttft_s - (rec.first_token_s - rec.arrival_s)) > EPS:
        raise TraceError(f"{where}: ttft_s ({rec.ttft_s}) is not first_token_s - arrival_s "
                         f"({rec.first_token_s - rec.arrival_s})")


class Trace(msgspec.Struct):
    header: Header
    requests: list[RequestRecord]
    flows: list[FlowRecord]

    def flows_by_request(self) -> dict[str, list[FlowRecord]]:
        out: dict[str, list[FlowRecord]] = {}
        for f in self.flows:
            out.setdefault(f.request_id or "", []).append(f)
        return out


class TraceWriter:
    """Writes a trace: the header at once, then each record as it comes (validated)."""

    def __init__(self, path: str | Path, header: Header):
        validate(header)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "wb")
        self._fh.write(_encoder.encode(header) + b"\n")
        self.count = 0

    def write(self, rec: RequestRecord | FlowRecord) -> None:
        validate(rec)
        self._fh.write(_encoder.encode(rec) + b"\n")
        self.count += 1

    def write_all(self, recs: Iterable[RequestRecord | FlowRecord]) -> None:
        for r in recs:
            self.write(r)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path) -> Trace:
    p = Path(path)
    try:
        lines = p.read_bytes().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e}") from None
    header: Header | None = None
    reqs: list[RequestRecord] = []
    flows: list[FlowRecord] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = _decoder.decode(line)
        except msgspec.ValidationError as e:
            raise TraceError(f"{p}: line {i}: {e}") from None
        except msgspec.DecodeError as e:
            raise TraceError(f"{p}: line {i}: not JSON: {e}") from None
        try:
            validate(rec)
        except TraceError as e:
            raise TraceError(f"{p}: line {i}: {e}") from None
        if isinstance(rec, Header):
            if header is not None or i != 1:
                raise TraceError(f"{p}: line {i}: the header must be the first line, and only once")
            header = rec
        elif header is None:
            raise TraceError(f"{p}: line {i}: the first line must be the header")
        elif isinstance(rec, RequestRecord):
            reqs.append(rec)
        else:
            flows.append(rec)
    if header is None:
        raise TraceError(f"{p}: empty trace (no header)")
    return Trace(header, reqs, flows)
