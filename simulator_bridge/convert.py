"""A trace from one of the simulator family's formats to another (``docs/formats.md``;
the command is ``kvpath bridge convert IN OUT``).

Every format is read into one bundle (header, requests, flows, flow inputs), which the
target writes if it can hold what it needs: a format missing from the source (fct.txt's
completion times from an HPCC file, requests from a flow file) is an error naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from kvpath.fabric import FabricSpec, FabricSpecError
from kvpath.trace import FlowRecord, Header, RequestRecord, Trace, TraceWriter, read_trace
from kvpath.trace.header import header_fabric
from kvpath.trace.formats import (REQUEST_METRICS_COLUMNS, SIMAI_COLUMNS, FlowInput, from_fct_txt, from_hpcc_flows,
                                  from_request_metrics_csv, from_simai_csv, to_fct_txt, to_hpcc_flows,
                                  to_request_metrics_csv, to_simai_csv)

log = logging.getLogger(__name__)

FORMATS = ("kvpath", "parquet", "simai", "fct", "hpcc", "request-metrics")
NEEDS_FABRIC = ("simai", "hpcc")  # node ids <-> hosts
# What each format holds: "requests", "flows" (with their outcome), "inputs" (flows to simulate)
HOLDS = {
    "kvpath": {"requests", "flows"}, "parquet": {"requests", "flows"}, "fct": {"flows"},
    "simai": {"inputs"}, "hpcc": {"inputs"}, "request-metrics": {"requests"},
}
NAMES = {"kvpath": "a kvpath trace", "parquet": "a Parquet trace", "fct": "an fct.txt", "simai": "a SimAI CSV",
         "hpcc": "an HPCC flow file", "request-metrics": "a request_metrics.csv"}


class ConvertError(ValueError):
    pass


@dataclass
class Bundle:
    """What was read: the header only from kvpath and Parquet traces."""

    fmt: str
    header: Header | None = None
    requests: list[RequestRecord] = field(default_factory=list)
    flows: list[FlowRecord] = field(default_factory=list)
    inputs: list[FlowInput] = field(default_factory=list)


# ---- guessing ---------------------------------------------------------------------------
def _csv_kind(path: Path) -> str | None:
    try:
        with open(path, errors="replace") as fh:
            first = fh.readline().strip()
    except OSError:
        return None
    cols = [c.strip() for c in first.split(",")]
    if all(c in cols for c in SIMAI_COLUMNS):
        return "simai"
    if all(c in cols for c in REQUEST_METRICS_COLUMNS):
        return "request-metrics"
    return None


def guess_format(path: str, output: bool = False) -> str:
    """The format a file name says (and, for an input CSV, its header)."""
    p = Path(path)
    name = p.name.lower()
    if p.is_dir() or name.endswith(".parquet") or path.endswith("/"):
        return "parquet"
    if name.endswith(".jsonl"):
        return "kvpath"
    if name == "fct.txt" or name.endswith(".fct"):
        return "fct"
    if name == "flow.txt" or name.endswith(".hpcc"):
        return "hpcc"
    if name.endswith(".csv"):
        if name.startswith("request_metrics"):
            return "request-metrics"
        kind = "simai" if output else _csv_kind(p)
        if kind:
            return kind
        raise ConvertError(f"{'--to' if output else '--from'}: cannot tell the format of {path}: its first line is "
                           f"neither the SimAI header ({','.join(SIMAI_COLUMNS)}) nor request_metrics.csv's")
    if not output and Path(str(p) + ".requests.parquet").is_file():
        return "parquet"
    flag = "--to" if output else "--from"
    raise ConvertError(f"{flag}: cannot tell the format of {path} from its name: give {flag} "
                       f"({', '.join(FORMATS)})")


# ---- the fabric -----------------------------------------------------------------------------
def _resolve(arg: str) -> FabricSpec:
    try:
        return FabricSpec.resolve(arg)
    except FabricSpecError as e:
        raise ConvertError(f"--fabric: {e}") from None


def _fabric(arg: str | None, header: Header | None, fmt: str, role: str) -> FabricSpec:
    """The spec that maps node ids to hosts: --fabric, else the input trace's header."""
    if arg is not None:
        return _resolve(arg)
    if header is not None and header.fabric:
        try:
            return header_fabric(header)
        except FabricSpecError as e:
            raise ConvertError(f"the input's header has a bad fabric ({e}): give --fabric") from None
    src = "the input has none" if header is not None else "only a kvpath or Parquet input carries one"
    raise ConvertError(f"--fabric: {role} {fmt}'s node ids needs the fabric (preset or spec file); {src}")


def _parquet() -> ModuleType:
    """kvpath.trace.parquet, imported only when Parquet is asked for: pyarrow is the bridge's extra."""
    try:
        import kvpath.trace.parquet as m
    except ImportError as e:
        raise ConvertError(f"parquet needs pyarrow (pip install -r requirements/bridge.txt): {e}") from None
    return m


# ---- reading and writing ----------------------------------------------------------------------
def read_any(path: str, fmt: str, fabric: str | None) -> Bundle:
    if fmt in ("kvpath", "parquet"):
        t = read_trace(path) if fmt == "kvpath" else _parquet().read_parquet(path)
        return Bundle(fmt, t.header, t.requests, t.flows)
    if fmt == "fct":
        return Bundle(fmt, flows=from_fct_txt(path))
    if fmt == "request-metrics":
        return Bundle(fmt, requests=from_request_metrics_csv(path))
    spec = _fabric(fabric, None, fmt, "reading")
    return Bundle(fmt, inputs=from_simai_csv(path, spec) if fmt == "simai" else from_hpcc_flows(path, spec))


def _missing(b: Bundle, to: str) -> str | None:
    """Why ``to`` cannot be written from ``b``, or None."""
    have, holds = HOLDS[b.fmt], HOLDS[to]
    src = NAMES[b.fmt]
    if "inputs" in have and "flows" in holds:
        return (f"{NAMES[to]} needs each flow's end time (its FCT); {src} holds flows to simulate only, "
                f"with no end times")
    if holds == {"requests"} and "requests" not in have:
        return f"{NAMES[to]} holds requests; {src} has none"
    if "requests" not in holds and not have & {"flows", "inputs"}:
        return f"{NAMES[to]} holds flows; {src} has none"
    return None


def _trace(b: Bundle, spec: FabricSpec | None) -> Trace:
    header = b.header or Header(t0_unix=0.0, fabric=spec.to_dict() if spec else {}, meta={"converted_from": b.fmt})
    return Trace(header, b.requests, b.flows)


def write_any(b: Bundle, path: str, to: str, fabric: str | None) -> tuple[int, int]:
    """Write ``b`` as ``to``; returns (requests, flows) written."""
    why = _missing(b, to)
    if why:
        raise ConvertError(f"cannot convert {b.fmt} to {to}: {why}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    flows = b.flows or b.inputs
    if to in NEEDS_FABRIC:
        spec = _fabric(fabric, b.header if b.fmt in ("kvpath", "parquet") else None, to, "writing")
        n = (to_simai_csv if to == "simai" else to_hpcc_flows)(flows, path, spec)
        return 0, n
    if to == "fct":
        return 0, to_fct_txt(b.flows, path)
    if to == "request-metrics":
        return to_request_metrics_csv(b.requests, path), 0
    # --fabric goes into the header of a trace made from a text format; a kvpath or
    # Parquet input keeps its own header
    trace = _trace(b, _resolve(fabric) if fabric is not None else None)
    if to == "parquet":
        _parquet().to_parquet(trace, path)
    else:
        with TraceWriter(path, trace.header) as w:
            w.write_all(trace.requests)
            w.write_all(trace.flows)
    return len(trace.requests), len(trace.flows)


def convert(src: str, dst: str, src_fmt: str | None = None, dst_fmt: str | None = None,
            fabric: str | None = None) -> dict[str, object]:
    """Read ``src``, write ``dst``; returns what was written and what was left out."""
    prefix = Path(src + ".requests.parquet")  # a Parquet trace named by its prefix
    if not Path(src).exists() and src_fmt != "parquet" and not prefix.exists():
        raise ConvertError(f"IN: no such file: {src}")
    src_fmt = src_fmt or guess_format(src)
    dst_fmt = dst_fmt or guess_format(dst, output=True)
    b = read_any(src, src_fmt, fabric)
    n_req, n_flow = write_any(b, dst, dst_fmt, fabric)
    dropped = {"requests": len(b.requests) - n_req, "flows": len(b.flows or b.inputs) - n_flow}
    for what, n in dropped.items():
        if n:
            log.debug("%s holds no %s: %d left out", dst_fmt, what, n)
    return {"in": src, "from": src_fmt, "out": dst, "to": dst_fmt, "requests": n_req, "flows": n_flow,
            "dropped_requests": dropped["requests"], "dropped_flows": dropped["flows"]}
