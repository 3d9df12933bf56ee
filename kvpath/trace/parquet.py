"""A kvpath trace as two Parquet tables, for traces of millions of flows.

``requests.parquet`` and ``flows.parquet``: one column per record field, in the
schema's order, the five-tuple flattened into ``src_ip, dst_ip, src_port, dst_port,
proto``; the header as JSON in each table's schema metadata (``kvpath.header``). The
columns follow :mod:`kvpath.trace`'s structs (read with ``msgspec.inspect``), so a
field added there is a column here. Columns are built and checked whole (lists and
pyarrow compute); only the rows a check flags go through :func:`kvpath.trace.validate`,
for its message.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, Sequence

import msgspec
import msgspec.inspect as mi
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvpath.five_tuple import FiveTuple
from kvpath.trace.records import (EPS, REQUEST_ORDER, FlowRecord, Header, RequestRecord, Trace, TraceError, upgrade,
                          validate)

HEADER_KEY = b"kvpath.header"
TABLE_KEY = b"kvpath.table"
TUPLE_FIELDS = FiveTuple.__struct_fields__
# optional columns a table written by an older kvpath lacks: read as nulls (a version-1
# trace's flows then get theirs from upgrade())
ADDED_LATER = {"flows": frozenset({"lane", "path_predicted"}), "requests": frozenset({"p_arrival_s"})}
_ARROW = {mi.StrType: pa.string(), mi.IntType: pa.int64(), mi.FloatType: pa.float64(), mi.BoolType: pa.bool_()}


def _columns(cls: type) -> list[tuple[str, str | None, pa.DataType, bool]]:
    """(column, the struct field it flattens or None, type, nullable) per column."""
    out = []
    for f in mi.type_info(cls).fields:
        t, nullable = f.type, False
        if isinstance(t, mi.UnionType):
            rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
            nullable, t = len(rest) < len(t.types), rest[0]
        if isinstance(t, mi.StructType) and t.cls is FiveTuple:
            out += [(g.name, f.name, _ARROW[type(g.type)], nullable) for g in t.fields]
        else:
            out.append((f.name, None, _ARROW[type(t)], nullable))
    return out


REQUEST_COLUMNS = _columns(RequestRecord)
FLOW_COLUMNS = _columns(FlowRecord)


def parquet_paths(path: str | Path) -> tuple[Path, Path]:
    """(requests, flows) files of a Parquet trace. A directory (existing, or a name
    ending in ``/`` or ``.parquet``) holds ``requests.parquet`` and ``flows.parquet``;
    any other name is a prefix: ``<prefix>.requests.parquet``, ``<prefix>.flows.parquet``."""
    s = str(path)
    p = Path(path)
    if p.name in ("requests.parquet", "flows.parquet"):
        p = p.parent
    elif not p.is_dir():
        for suffix in (".requests.parquet", ".flows.parquet"):
            if p.name.endswith(suffix):
                stem = p.name[: -len(suffix)]
                return p.with_name(stem + ".requests.parquet"), p.with_name(stem + ".flows.parquet")
        if not (s.endswith(("/", os.sep)) or p.suffix == ".parquet"):
            return p.with_name(p.name + ".requests.parquet"), p.with_name(p.name + ".flows.parquet")
    return p / "requests.parquet", p / "flows.parquet"


# ---- building -------------------------------------------------------------------------
def _tuple_value(rec: Any, field: str, sub: str) -> Any:
    ft = getattr(rec, field)
    return None if ft is None else getattr(ft, sub)


def _table(records: Sequence[Any], columns: list[tuple[str, str | None, pa.DataType, bool]], what: str,
           metadata: dict[bytes, bytes]) -> pa.Table:
    arrays = []
    for name, parent, typ, nullable in columns:
        if parent is None:
            values = [getattr(r, name) for r in records]
        else:
            fts = [getattr(r, parent) for r in records]
            values = [None if ft is None else getattr(ft, name) for ft in fts]
        try:
            arrays.append(pa.array(values, type=typ))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise TraceError(f"{what}: column {name}: {e}") from None
    fields = [pa.field(name, typ, nullable=nullable) for name, _, typ, nullable in columns]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))


def to_parquet(trace: Trace, out: str | Path) -> tuple[Path, Path]:
    """Write the trace's two tables (see :func:`parquet_paths`); every record is
    validated first, as ``TraceWriter`` does. Returns the two files."""
    validate(trace.header)
    req_path, flow_path = parquet_paths(out)
    header = msgspec.json.encode(trace.header)
    tables = {}
    for name, recs, cols in (("requests", trace.requests, REQUEST_COLUMNS), ("flows", trace.flows, FLOW_COLUMNS)):
        t = _table(recs, cols, name, {HEADER_KEY: header, TABLE_KEY: name.encode()})
        _check(t, recs, name, lambda i, n=name: f"{n} row {i}")
        tables[name] = t
    req_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(tables["requests"], req_path)
    pq.write_table(tables["flows"], flow_path)
    return req_path, flow_path


# ---- checking whole columns -------------------------------------------------------------
def _mask(t: pa.Table, expr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(expr, False), dtype=bool) if len(t) else np.zeros(0, bool)


def _nonnull(t: pa.Table, col: str) -> pa.ChunkedArray:
    return pc.is_valid(t.column(col))


def _bad_tuple(t: pa.Table) -> np.ndarray:
    """Rows whose five-tuple (when there is one) validate() would refuse."""
    bad = np.zeros(len(t), bool)
    for col in ("src_ip", "dst_ip"):
        values = pc.unique(t.column(col)).drop_null().to_pylist()  # few distinct hosts: check each once
        wrong = []
        for v in values:
            try:
                ipaddress.ip_address(v)
            except ValueError:
                wrong.append(v)
        if wrong:
            bad |= _mask(t, pc.is_in(t.column(col), value_set=pa.array(wrong, pa.string())))
    for col in ("src_port", "dst_port"):
        c = t.column(col)
        bad |= _mask(t, pc.or_(pc.less(c, 0), pc.greater(c, 65535)))
    bad |= _mask(t, pc.and_(_nonnull(t, "proto"), pc.invert(pc.is_in(t.column("proto"),
                                                                    value_set=pa.array(["tcp", "udp"])))))
    return bad


def _not_finite(t: pa.Table, *cols: str) -> np.ndarray:
    bad = np.zeros(len(t), bool)
    for c in cols:
        bad |= _mask(t, pc.invert(pc.is_finite(t.column(c))))
    return bad


def _suspect_flows(t: pa.Table) -> np.ndarray:
    bad = _bad_tuple(t) | _not_finite(t, "start_s", "end_s", "standalone_fct_s")
    bad |= _mask(t, pc.less(t.column("bytes"), 0))
    bad |= _mask(t, pc.less(t.column("end_s"), t.column("start_s")))
    return bad | _mask(t, pc.less(t.column("standalone_fct_s"), 0))


def _suspect_requests(t: pa.Table) -> np.ndarray:
    c = t.column
    bad = _bad_tuple(t) | _not_finite(t, "arrival_s", "p_arrival_s", "ttft_s", "tpot_s")
    for col in ("prompt_tokens", "output_tokens", "kv_bytes"):
        bad |= _mask(t, pc.less(c(col), 0))
    for a, b in REQUEST_ORDER:
        bad |= _mask(t, pc.less(pc.add(c(b), EPS), c(a)))
    # a wider margin than validate's: rounding differs, and validate decides flagged rows
    gap = pc.abs(pc.subtract(c("ttft_s"), pc.subtract(c("first_token_s"), c("arrival_s"))))
    return bad | _mask(t, pc.greater(gap, EPS / 2))


def _check(t: pa.Table, records: Sequence[Any], what: str, where: Any) -> None:
    suspect = _suspect_requests(t) if what == "requests" else _suspect_flows(t)
    for i in np.flatnonzero(suspect):
        try:
            validate(records[i])
        except TraceError as e:
            raise TraceError(f"{where(int(i))}: {e}") from None


# ---- reading ------------------------------------------------------------------------------
def _read_table(path: Path, what: str, columns: list[tuple[str, str | None, pa.DataType, bool]]) -> pa.Table:
    if not path.is_file():
        raise TraceError(f"{path}: no such file (a Parquet trace is requests.parquet and flows.parquet)")
    try:
        t = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{path}: not a Parquet file: {e}") from None
    meta = t.schema.metadata or {}
    if meta.get(TABLE_KEY, what.encode()) != what.encode():
        raise TraceError(f"{path}: holds the {meta[TABLE_KEY].decode()} table, not the {what}")
    out = []
    for name, _, typ, nullable in columns:
        if name not in t.column_names:
            if not (nullable and name in ADDED_LATER[what]):
                raise TraceError(f"{path}: missing column {name}")
            out.append(pa.nulls(len(t), typ))
            continue
        col = t.column(name)
        try:
            col = col.cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TraceError(f"{path}: column {name}: expected {typ}, got {t.schema.field(name).type}: {e}") from None
        if not nullable and col.null_count:
            row = int(np.flatnonzero(np.asarray(pc.is_null(col)))[0])
            raise TraceError(f"{path}: row {row}: column {name} is null")
        out.append(col)
    return pa.Table.from_arrays(out, names=[c[0] for c in columns]).replace_schema_metadata(meta)


def _header(path: Path, t: pa.Table) -> Header:
    raw = (t.schema.metadata or {}).get(HEADER_KEY)
    if raw is None:
        raise TraceError(f"{path}: no kvpath header in the schema metadata ({HEADER_KEY.decode()})")
    try:
        h = msgspec.json.decode(raw, type=Header)
        validate(h)
    except (msgspec.ValidationError, msgspec.DecodeError, TraceError) as e:
        raise TraceError(f"{path}: header: {e}") from None
    return h


def _records(t: pa.Table, cls: type, columns: list[tuple[str, str | None, pa.DataType, bool]]) -> list[Any]:
    values = {name: t.column(name).to_pylist() for name, *_ in columns}
    plain = [name for name, parent, *_ in columns if parent is None]
    parent = next((p for _, p, *_ in columns if p is not None), None)
    fts: list[FiveTuple | None] = [None] * len(t)
    if parent is not None:
        fts = [None if src is None else FiveTuple(src, dst, sp, dp, proto)
               for src, dst, sp, dp, proto in zip(*(values[f] for f in TUPLE_FIELDS))]
    rows = zip(*(values[n] for n in plain)) if plain else iter([()] * len(t))
    return [cls(**dict(zip(plain, row)), **({parent: ft} if parent else {})) for row, ft in zip(rows, fts)]


def _partial_tuples(path: Path, t: pa.Table) -> None:
    nulls = [np.asarray(pc.is_null(t.column(f)), dtype=bool) for f in TUPLE_FIELDS]
    mixed = np.any(nulls, axis=0) & ~np.all(nulls, axis=0) if len(t) else np.zeros(0, bool)
    if mixed.any():
        row = int(np.flatnonzero(mixed)[0])
        raise TraceError(f"{path}: row {row}: five-tuple columns are partly null ({', '.join(TUPLE_FIELDS)})")


def read_parquet(path: str | Path) -> Trace:
    """The trace written by :func:`to_parquet`, validated as ``read_trace`` does; errors
    name the file, the row (0-based) and the field."""
    req_path, flow_path = parquet_paths(path)
    rt = _read_table(req_path, "requests", REQUEST_COLUMNS)
    ft = _read_table(flow_path, "flows", FLOW_COLUMNS)
    header = _header(req_path, rt)
    if _header(flow_path, ft) != header:
        raise TraceError(f"{flow_path}: its header differs from {req_path}'s: the tables come from different traces")
    _partial_tuples(req_path, rt)
    out = []
    for p, t, cls, cols, what in ((req_path, rt, RequestRecord, REQUEST_COLUMNS, "requests"),
                                  (flow_path, ft, FlowRecord, FLOW_COLUMNS, "flows")):
        recs = _records(t, cls, cols)
        _check(t, recs, what, lambda i, p=p: f"{p}: row {i}")
        out.append(recs)
    return upgrade(Trace(header, out[0], out[1]))
