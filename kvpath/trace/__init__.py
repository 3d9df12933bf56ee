"""The trace: one schema for what the testbed measures and what the simulator predicts.

- :mod:`~kvpath.trace.records`: the schema: the records (requests, flows, the
  connector's transfers, receipts and lanes), their validation, ``Trace``;
- :mod:`~kvpath.trace.writer`: ``TraceWriter``;
- :mod:`~kvpath.trace.reader`: ``read_trace``, ``read_connector_log``, ``read_transfers``;
- :mod:`~kvpath.trace.rotation`: the connector's log files, rotated when full;
- :mod:`~kvpath.trace.header`: what a trace's header says about its setup;
- :mod:`~kvpath.trace.formats`: other tools' formats (ns-3 FCT text, SimAI CSV, vLLM's
  request metrics);
- :mod:`~kvpath.trace.parquet`: the Parquet form;
- :mod:`~kvpath.trace.metrics`: a trace's summary numbers.

The names of records, writer and reader (``__all__`` below) are re-exported here:
``from kvpath.trace import Trace``.
"""

from kvpath.trace.reader import read_connector_log, read_trace, read_transfers
from kvpath.trace.records import (EPS, READS_VERSIONS, REQUEST_ORDER, SCHEMA_VERSION, ConnectorLog, FiveTuple,
                                  FlowRecord, Header, LaneRecord, LanesRecord, ReceivedRecord, Record, RequestRecord,
                                  Trace, TraceError, TransferRecord, kv_ready_at, received_by_flow, upgrade, validate)
from kvpath.trace.writer import TraceWriter

__all__ = [
    "SCHEMA_VERSION", "READS_VERSIONS", "EPS", "REQUEST_ORDER", "TraceError", "FiveTuple", "Header", "RequestRecord",
    "FlowRecord", "TransferRecord", "ReceivedRecord", "LaneRecord", "LanesRecord", "Record", "Trace", "ConnectorLog",
    "validate", "TraceWriter", "read_trace", "upgrade", "read_connector_log", "read_transfers", "kv_ready_at",
    "received_by_flow",
]
