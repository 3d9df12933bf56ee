"""The trace: one versioned schema for what a run did, written by the testbed and the
connector and read by the simulator bridge and the testbed. ``docs/trace.md`` documents
every field.

A run's trace is a JSON Lines file: a ``header`` first, then ``request`` and ``flow``
records in any order. Times are seconds since the run's start (the header's
``t0_unix``), on one clock. A request owns its flows (``FlowRecord.request_id``): one
per push today, one per TP rank pair later.

A connector's log is a headerless JSON Lines file of the same schema: ``transfer``
(one per push, seen from P), ``received`` (D has a push's last byte) and ``lanes``
(P opened its lanes to a D worker) records, times in unix seconds. Every process and
thread of a connector appends to it through :class:`TraceWriter`;
:func:`read_transfers` and :func:`read_connector_log` read it back, and also read logs
written before schema version 2 (rows tagged ``"kind"``).

Every record is validated on write and on read; a bad record raises
:class:`TraceError` naming the record and the field.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import threading
from pathlib import Path
from typing import IO, Any, Iterable, Union

import msgspec

from kvpath.five_tuple import PROTOS, FiveTuple
from kvpath.trace.rotation import log_files, rotate_if_full

__all__ = [
    "SCHEMA_VERSION", "READS_VERSIONS", "EPS", "REQUEST_ORDER", "TraceError", "FiveTuple", "Header", "RequestRecord", "FlowRecord",
    "TransferRecord", "ReceivedRecord", "LaneRecord", "LanesRecord", "Record", "Trace", "ConnectorLog", "validate",
    "TraceWriter", "read_trace", "upgrade", "read_connector_log", "read_transfers", "kv_ready_at", "received_by_flow",
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


class TraceWriter:
    """Writes trace records, each validated, one JSON line each; safe from several threads.

    With a header: a run's trace, the file truncated and the header written first.
    Without one: a connector's log, appended to (several processes may share the file);
    ``{pid}`` in the path becomes this process's id, and ``max_bytes`` rotates it
    (:mod:`kvpath.trace.rotation`, ``keep`` old files). A ``None`` path writes nothing."""

    def __init__(self, path: str | Path | None, header: Header | None = None, max_bytes: int | None = None,
                 keep: int = 3):
        self._lock = threading.Lock()
        self._fh: IO[bytes] | None = None
        self.count = 0
        self.path: Path | None = None
        self._max_bytes = max_bytes if header is None else None  # a run's trace is one file
        self._keep = keep
        if path is None or str(path) == "":
            return
        if header is not None:
            validate(header)
        self.path = Path(str(path).replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if header is None:
            # unbuffered: each record is one write() of one whole line, so concurrent
            # appenders (P's TP workers, a reader polling) never see half a line
            self._fh = open(self.path, "ab", buffering=0)
        else:
            self._fh = open(self.path, "wb")
            self._fh.write(_encoder.encode(header) + b"\n")

    def write(self, rec: Record) -> None:
        if self._fh is None:
            return
        if isinstance(rec, Header):
            raise TraceError("header: written once, by TraceWriter(path, header)")
        validate(rec)
        line = _encoder.encode(rec) + b"\n"
        with self._lock:
            if self._fh is not None:
                view = memoryview(line)
                while view:  # an unbuffered write may be short (a nearly full disk): finish the line
                    n = self._fh.write(view)
                    if not n:
                        raise OSError(f"{self.path}: no progress writing a trace record")
                    view = view[n:]
                self.count += 1
                if self._max_bytes is not None and self.path is not None:
                    try:
                        self._fh = rotate_if_full(self.path, self._fh, self._max_bytes, self._keep)
                    except OSError as e:  # the record is written; rotation stops, once, loudly
                        self._max_bytes = None
                        logging.getLogger(__name__).error("%s: cannot rotate (%s); appending from now on",
                                                          self.path, e)

    def write_all(self, recs: Iterable[Record]) -> None:
        for r in recs:
            self.write(r)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_lines(p: Path) -> list[bytes]:
    try:
        return p.read_bytes().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e}") from None


def _decode(p: Path, i: int, line: bytes) -> Record:
    try:
        rec = _decoder.decode(line)
    except msgspec.ValidationError as e:
        raise TraceError(f"{p}: line {i}: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TraceError(f"{p}: line {i}: not JSON: {e}") from None
    try:
        validate(rec)
    except TraceError as e:
        raise TraceError(f"{p}: line {i}: {e}") from None
    return rec


def read_trace(path: str | Path) -> Trace:
    """A run's trace, in the current schema's model (a version-1 trace is upgraded)."""
    p = Path(path)
    header: Header | None = None
    reqs: list[RequestRecord] = []
    flows: list[FlowRecord] = []
    for i, line in enumerate(_read_lines(p), 1):
        if not line.strip():
            continue
        rec = _decode(p, i, line)
        if isinstance(rec, Header):
            if header is not None or i != 1:
                raise TraceError(f"{p}: line {i}: the header must be the first line, and only once")
            header = rec
        elif header is None:
            raise TraceError(f"{p}: line {i}: the first line must be the header")
        elif isinstance(rec, RequestRecord):
            reqs.append(rec)
        elif isinstance(rec, FlowRecord):
            flows.append(rec)
        else:
            raise TraceError(f"{p}: line {i}: a {type(rec).__name__} belongs in a connector's log, not a run's trace")
    if header is None:
        raise TraceError(f"{p}: empty trace (no header)")
    return upgrade(Trace(header, reqs, flows))


# ---- the connector's log ---------------------------------------------------------------
class ConnectorLog(msgspec.Struct):
    transfers: list[TransferRecord]
    received: list[ReceivedRecord]
    lanes: list[LanesRecord]


_V1_KINDS = {"kv_transfer": TransferRecord, "kv_received": ReceivedRecord, "lanes": LanesRecord}


def _from_v1(row: dict[str, Any]) -> ConnectorRecord:
    """A row of a log written before schema version 2 (``{"kind": ...}``, no ``type``)."""
    kind = row.pop("kind")
    if kind == "kv_transfer":
        row.pop("duration_s", None)  # derived: a property now
    elif kind == "lanes":
        # each lane was [lane id, src ip, src port, dst ip, dst port, proto, path]
        row["lanes"] = [{"lane": ln[0], "path": ln[6] or None,
                         "five_tuple": {"src_ip": ln[1], "dst_ip": ln[3], "src_port": ln[2], "dst_port": ln[4],
                                        "proto": ln[5]} if ln[2] else None} for ln in row.get("lanes", [])]
    return msgspec.convert(row, _V1_KINDS[kind])


def read_connector_log(path: str | Path) -> ConnectorLog:
    """A connector's log: its transfer, received and lanes records in file order, from a
    log of either schema version, its rotated files (``path.N`` ... ``path.1``) included.
    Records of a run's trace in it are skipped. A last line
    without its newline is one being written now, and is skipped too."""
    out = ConnectorLog([], [], [])
    p = Path(path)
    for f in [f for f in log_files(p) if f != p]:  # rotated files (trace_max_bytes) first, oldest first
        _read_connector_file(f, out)
    _read_connector_file(p, out)
    return out


def _read_connector_file(p: Path, out: ConnectorLog) -> None:
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read connector log {p}: {e}") from None
    lines = data.splitlines()
    if lines and not data.endswith(b"\n"):
        lines.pop()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if b'"kind"' in line and b'"type"' not in line:
            try:
                row = msgspec.json.decode(line)
                if not isinstance(row, dict):
                    raise TraceError("a record must be a JSON object")
                rec: Record = _from_v1(row)
                validate(rec)
            except (msgspec.ValidationError, msgspec.DecodeError, KeyError, IndexError, TypeError, TraceError,
                    UnicodeDecodeError, RecursionError, AttributeError) as e:
                raise TraceError(f"{p}: line {i}: {e}") from None
        else:
            rec = _decode(p, i, line)
        if isinstance(rec, TransferRecord):
            out.transfers.append(rec)
        elif isinstance(rec, ReceivedRecord):
            out.received.append(rec)
        elif isinstance(rec, LanesRecord):
            out.lanes.append(rec)


def read_transfers(path: str | Path) -> list[TransferRecord]:
    """P's transfer records in a connector's log (see :func:`read_connector_log`)."""
    return read_connector_log(path).transfers
