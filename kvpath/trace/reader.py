"""Reading trace records back: a run's trace (:func:`read_trace`) and a connector's log
(:func:`read_connector_log`, :func:`read_transfers`), each record decoded and validated.

:func:`read_trace` upgrades a version-1 trace to the current schema's model;
:func:`read_connector_log` also reads logs written before schema version 2 (rows tagged
``"kind"``) and a log's rotated files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from kvpath.trace.records import (ConnectorLog, ConnectorRecord, FlowRecord, Header, LanesRecord, ReceivedRecord,
                                  Record, RequestRecord, Trace, TraceError, TransferRecord, upgrade, validate)
from kvpath.trace.rotation import log_files

__all__ = ["read_trace", "read_connector_log", "read_transfers"]

_decoder = msgspec.json.Decoder(Record)


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
