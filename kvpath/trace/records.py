"""The trace's schema: its records (a run's header, requests and flows; the connector's
transfers, receipts and lanes), their validation and the schema's versions.
``docs/trace.md`` documents every field; :mod:`kvpath.trace.writer` writes the records
and :mod:`kvpath.trace.reader` reads them back.

A run's trace is a JSON Lines file: a ``header`` first, then ``request`` and ``flow``
records in any order. Times are seconds since the run's start (the header's
``t0_unix``), on one clock. A request owns its flows (``FlowRecord.request_id``): one
per push today, one per TP rank pair later.

A connector's log is a headerless JSON Lines file of the same schema: ``transfer``
(one per push, seen from P), ``received`` (D has a push's last byte) and ``lanes``
(P opened its lanes to a D worker) records, times in unix seconds.

Every record is validated on write and on read (:func:`validate`); a bad record raises
:class:`TraceError` naming the record and the field.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any, Iterable, Union

import msgspec

from kvpath.five_tuple import PROTOS, FiveTuple

__all__ = [
    "SCHEMA_VERSION", "READS_VERSIONS", "EPS", "REQUEST_ORDER", "TraceError", "FiveTuple", "Header", "RequestRecord",
    "FlowRecord", "TransferRecord", "ReceivedRecord", "LaneRecord", "LanesRecord", "Record", "ConnectorRecord",
    "Trace", "ConnectorLog", "validate", "upgrade", "kv_ready_at", "received_by_flow",
]

# 2: flows carry their lane and predicted path (a request may own several flows); the
# connector's records joined the schema.
SCHEMA_VERSION = 2
READS_VERSIONS = (1, 2)
EPS = 1e-6  # one microsecond: the slack for derived times


# (earlier, later): a request's times that may not go backwards (by more than EPS)
REQUEST_ORDER = (("arrival_s", "p_arrival_s"), ("p_arrival_s", "prefill_start_s"), ("p_arrival_s", "first_token_s"),
                 ("prefill_start_s", "prefill_end_s"), ("push_start_s", "push_end_s"),
                 ("arrival_s", "first_token_s"), ("first_token_s", "completion_s"))


class TraceError(ValueError):
    pass


class Header(msgspec.Struct, tag="header", kw_only=True):
    version: int = SCHEMA_VERSION
    t0_unix: float  # the run's start, unix seconds: every other time is relative to it
    mode: str = ""  # ecmp | cc | dc | pull | ...
    fabric: dict[str, Any] = {}  # kvpath.fabric.FabricSpec.to_dict()
    scale_b: float = 1.0  # link rates divided by B
    scale_s: float = 1.0  # KV bytes divided by S
    link_mbit: float | None = None  # the testbed's spine-link rate (every link's in older traces)
    host_link_mbit: float | None = None  # the testbed's host-link rate; None: link_mbit x the spec's ratio
    meta: dict[str, Any] = {}


class RequestRecord(msgspec.Struct, tag="request", kw_only=True):
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    status: str = "ok"
    p_instance: str | None = None
    d_instance: str | None = None
    # P's server received it: the end of the front end (the client, the proxy, P's HTTP
    # server); None where the engine does not say (vLLM's servers)
    p_arrival_s: float | None = None
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    kv_bytes: int | None = None  # all of the request's flows together
    push_start_s: float | None = None  # the first flow's start
    push_end_s: float | None = None  # the last flow's end
    # The push's lane, 5-tuple and paths when it was one flow; null when it had several
    # (each flow record carries its own).
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
    lane: int | None = None  # the connector lane it went on
    path_predicted: str | None = None  # the spine the reservation service chose for it

    @property
    def fct_s(self) -> float:
        return self.end_s - self.start_s


class TransferRecord(msgspec.Struct, tag="transfer"):
    """One push, seen from P's connector. Times are unix seconds (``time.time()``)."""

    transfer_id: str
    request_id: str  # P's request id
    peer_engine: str = ""
    peer_request_id: str = ""  # D's request id
    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    lane: int = -1  # -1: no lane (the push never got one)
    src_port: int = 0  # the lane's source port; 0 when not learned
    lease_id: str = ""  # the path reservation this push used, if any
    registered_at: float | None = None  # D's registration arrived
    prefill_done_at: float | None = None  # P's request finished
    submit_at: float | None = None  # WRITE posted
    first_byte_at: float | None = None  # not observable through NIXL/UCX: stays None
    completed_at: float | None = None
    status: str = "ok"  # ok | failed | expired | cancelled | rejected
    detail: str = ""
    five_tuple: FiveTuple | None = None  # the lane's, when learned
    # P's and D's TP rank: at TP > 1 a request has one push per (P rank, D rank) pair.
    # Last, so positional construction of the fields above keeps its meaning.
    rank: int = 0
    peer_rank: int = 0
    # vLLM's own times of P's request (unix s, None where vLLM kept no stats): it reached
    # P's engine, entered its queue, was first scheduled (its prefill began)
    p_arrival_at: float | None = None
    p_queued_at: float | None = None
    p_scheduled_at: float | None = None
    # How the push left P (connector push_granularity): "request" in one WRITE after the
    # prefill, or "layer": ``writes`` WRITEs of layer groups (``layers`` layers in all)
    # while P computed, ``overlap_bytes`` of them landed before P's forward ended (as the writer saw it)
    granularity: str = "request"
    writes: int = 0
    layers: int = 0
    overlap_bytes: int = 0

    @property
    def duration_s(self) -> float | None:
        if self.submit_at is None or self.completed_at is None:
            return None
        return self.completed_at - self.submit_at


class ReceivedRecord(msgspec.Struct, tag="received", kw_only=True):
    """D's connector has a push's last byte (its completion notification)."""

    transfer_id: str
    request_id: str  # D's request id
    engine: str = ""
    at: float  # unix seconds
    rank: int = 0  # D's TP rank: a request at TP > 1 lands one flow per rank pair
    # the P rank whose flow this is (P's TP size above D's: several per D rank); -1:
    # not recorded (older logs), the P rank equal TP sizes pair with ``rank``
    peer_rank: int = -1


def received_by_flow(records: Iterable[ReceivedRecord]) -> dict[tuple[str, int, int], float]:
    """(transfer id, P rank, D rank) -> when that flow's last byte was on D. A P
    record's flow is (its transfer id, its ``rank``, its ``peer_rank``); the request's KV
    is on D when the last of its flows is (the latest of them)."""
    out: dict[tuple[str, int, int], float] = {}
    for r in records:  # a flow recorded twice (a rotated log read whole): its latest
        key = (r.transfer_id, r.peer_rank if r.peer_rank >= 0 else r.rank, r.rank)
        out[key] = max(out.get(key, r.at), r.at)
    return out


def kv_ready_at(records: Iterable[ReceivedRecord]) -> dict[str, float]:
    """transfer id -> the latest arrival among its flows' receipts: when D had every
    flow of it, where every flow has a receipt (a flow whose push failed has none: the
    request then failed on D, which the caller learns from the request's own record)."""
    out: dict[str, float] = {}
    for (tid, _p, _d), at in received_by_flow(records).items():
        out[tid] = max(out.get(tid, at), at)
    return out


class LaneRecord(msgspec.Struct, kw_only=True):
    lane: int
    five_tuple: FiveTuple | None = None  # None: the connection could not be told apart
    path: str | None = None  # the path oracle's answer; None without one


class LanesRecord(msgspec.Struct, tag="lanes", kw_only=True):
    """P's connector opened its lanes to one D worker."""

    peer: str  # D worker's NIXL agent name
    engine: str = ""
    lanes: list[LaneRecord] = []


Record = Union[Header, RequestRecord, FlowRecord, TransferRecord, ReceivedRecord, LanesRecord]
ConnectorRecord = Union[TransferRecord, ReceivedRecord, LanesRecord]


def _check_tuple(ft: FiveTuple, where: str) -> None:
    for name in ("src_ip", "dst_ip"):
        try:
            ipaddress.ip_address(getattr(ft, name))
        except ValueError:
            raise TraceError(f"{where}: five_tuple.{name} is not an IP address: {getattr(ft, name)!r}") from None
    for name in ("src_port", "dst_port"):
        if not 0 <= getattr(ft, name) <= 65535:
            raise TraceError(f"{where}: five_tuple.{name} must be in [0, 65535], got {getattr(ft, name)}")
    if ft.proto not in PROTOS:
        raise TraceError(f"{where}: five_tuple.proto must be tcp or udp, got {ft.proto!r}")


def _finite(where: str, **vals: float | None) -> None:
    for name, v in vals.items():
        if v is not None and not math.isfinite(v):
            raise TraceError(f"{where}: {name} must be a finite number, got {v!r}")


def _validate_connector(rec: ConnectorRecord) -> None:
    if isinstance(rec, LanesRecord):
        for ln in rec.lanes:
            if ln.five_tuple is not None:
                _check_tuple(ln.five_tuple, f"lanes to {rec.peer!r}: lane {ln.lane}")
        return
    if isinstance(rec, ReceivedRecord):
        _finite(f"received {rec.transfer_id!r}", at=rec.at)
        return
    where = f"transfer {rec.transfer_id!r}"
    for name in ("bytes", "descriptors", "blocks"):
        if getattr(rec, name) < 0:
            raise TraceError(f"{where}: {name} must be >= 0, got {getattr(rec, name)}")
    if not 0 <= rec.src_port <= 65535:
        raise TraceError(f"{where}: src_port must be in [0, 65535], got {rec.src_port}")
    if rec.five_tuple is not None:
        _check_tuple(rec.five_tuple, where)
    _finite(where, registered_at=rec.registered_at, prefill_done_at=rec.prefill_done_at, submit_at=rec.submit_at,
            first_byte_at=rec.first_byte_at, completed_at=rec.completed_at)


def validate(rec: Record) -> None:
    if isinstance(rec, Header):
        if rec.version not in READS_VERSIONS:
            raise TraceError(f"header: schema version {rec.version} is not supported "
                             f"(this kvpath reads {', '.join(map(str, READS_VERSIONS))})")
        if rec.scale_b <= 0 or rec.scale_s <= 0:
            raise TraceError("header: scale_b and scale_s must be > 0")
        return
    if isinstance(rec, (TransferRecord, ReceivedRecord, LanesRecord)):
        _validate_connector(rec)
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
    _finite(where, arrival_s=rec.arrival_s, p_arrival_s=rec.p_arrival_s, ttft_s=rec.ttft_s, tpot_s=rec.tpot_s)
    for a, b in REQUEST_ORDER:
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

    def flows_of(self, request_id: str) -> list[FlowRecord]:
        """The flows a request owns (one per push today; one per TP rank pair later)."""
        return [f for f in self.flows if f.request_id == request_id]


def upgrade(trace: Trace) -> Trace:
    """The trace in the current schema's model (in place): a version-1 trace gives each
    flow its request's lane and predicted path (a v1 request owned at most one flow)."""
    if trace.header.version == SCHEMA_VERSION:
        return trace
    reqs = {r.request_id: r for r in trace.requests}
    for f in trace.flows:
        r = reqs.get(f.request_id or "")
        if r is not None:
            f.lane = f.lane if f.lane is not None else r.lane
            f.path_predicted = f.path_predicted if f.path_predicted is not None else r.path_predicted
    trace.header.version = SCHEMA_VERSION
    return trace


class ConnectorLog(msgspec.Struct):
    """A connector's log, read back (:func:`kvpath.trace.reader.read_connector_log`)."""

    transfers: list[TransferRecord]
    received: list[ReceivedRecord]
    lanes: list[LanesRecord]
