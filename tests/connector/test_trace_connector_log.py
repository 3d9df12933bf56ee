"""The connector's log: transfer, received and lanes records of the trace schema, written
by several threads through kvpath.trace.TraceWriter and read back by read_transfers and
read_connector_log, including logs written before schema version 2."""

from __future__ import annotations

import os
import threading

import pytest

from kvpath.five_tuple import FiveTuple
from kvpath.trace import (LaneRecord, LanesRecord, ReceivedRecord, TraceError, TraceWriter, TransferRecord,
                          read_connector_log, read_transfers)

# rows as connector/telemetry.py wrote them before schema version 2
V1_LOG = """\
{"kind": "lanes", "engine": "P0", "lanes": [[0, "10.0.2.1", 41000, "10.1.2.1", 40123, "tcp", "spine1"], [1, "", 0, "", 0, "tcp", ""]], "peer": "D0-agent"}
{"blocks": 3, "bytes": 49152, "completed_at": 1700000000.25, "descriptors": 6, "detail": "", "duration_s": 0.05, "first_byte_at": null, "kind": "kv_transfer", "lane": 1, "lease_id": "r7", "peer_engine": "D0", "peer_request_id": "d-1", "prefill_done_at": 1700000000.1, "registered_at": 1700000000.0, "request_id": "p-1", "src_port": 41000, "status": "ok", "submit_at": 1700000000.2, "transfer_id": "t1"}
{"blocks": 0, "bytes": 0, "completed_at": null, "descriptors": 0, "detail": "lease expired", "duration_s": null, "first_byte_at": null, "kind": "kv_transfer", "lane": -1, "lease_id": "", "peer_engine": "", "peer_request_id": "", "prefill_done_at": 1700000001.0, "registered_at": null, "request_id": "p-2", "src_port": 0, "status": "expired", "submit_at": null, "transfer_id": "t2"}
{"at": 1700000000.26, "engine": "D0", "kind": "kv_received", "request_id": "d-1", "transfer_id": "t1"}
"""


def test_a_log_written_before_version_2_reads_as_records(tmp_path):
    p = tmp_path / "old.jsonl"
    p.write_text(V1_LOG)
    t1, t2 = read_transfers(p)
    assert (t1.transfer_id, t1.request_id, t1.bytes, t1.descriptors, t1.blocks, t1.lane, t1.src_port, t1.lease_id) == \
        ("t1", "p-1", 49152, 6, 3, 1, 41000, "r7")
    assert t1.duration_s == pytest.approx(0.05) and t1.status == "ok" and t1.peer_engine == "D0"
    assert t2.status == "expired" and t2.duration_s is None and t2.detail == "lease expired"
    log = read_connector_log(p)
    assert log.received == [ReceivedRecord(transfer_id="t1", request_id="d-1", engine="D0", at=1700000000.26)]
    (lanes,) = log.lanes
    assert lanes.peer == "D0-agent" and lanes.lanes == [
        LaneRecord(lane=0, five_tuple=FiveTuple("10.0.2.1", "10.1.2.1", 41000, 40123), path="spine1"),
        LaneRecord(lane=1, five_tuple=None, path=None)]


def test_threads_append_records_and_the_reader_gets_each_once(tmp_path):
    path = str(tmp_path / "log-{pid}.jsonl")
    w = TraceWriter(path)
    assert w.path == tmp_path / f"log-{os.getpid()}.jsonl"
    ft = FiveTuple("10.0.2.1", "10.1.2.1", 41000, 40123)

    def push(k: int) -> None:
        for i in range(200):
            w.write(TransferRecord(f"t{k}-{i}", f"p{k}-{i}", bytes=i, lane=k, src_port=41000, submit_at=1.0,
                                   completed_at=1.5, five_tuple=ft))

    threads = [threading.Thread(target=push, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    w.write(LanesRecord(peer="D0", engine="P0", lanes=[LaneRecord(lane=0, five_tuple=ft, path="spine0")]))
    for t in threads:
        t.join()
    w.close()
    w2 = TraceWriter(path)  # a second writer (a restart, another TP worker) appends
    w2.write(ReceivedRecord(transfer_id="t0-0", request_id="d", at=2.0))
    w2.close()
    log = read_connector_log(w.path)
    assert sorted(r.transfer_id for r in log.transfers) == sorted(f"t{k}-{i}" for k in range(4) for i in range(200))
    assert all(r.duration_s == 0.5 and r.five_tuple == ft for r in log.transfers)
    assert log.lanes[0].lanes[0].path == "spine0" and log.received[0].at == 2.0
    assert '"type":"transfer"' in w.path.read_text().splitlines()[0] or '"type":"lanes"' in w.path.read_text()


def test_a_line_being_written_is_skipped_and_a_bad_one_is_named(tmp_path):
    p = tmp_path / "log.jsonl"
    with TraceWriter(p) as w:
        w.write(TransferRecord("t1", "p1", bytes=10))
    with open(p, "ab") as f:
        f.write(b'{"type":"transfer","transfer_id":"t2","req')  # the writer is mid-line
    assert [r.transfer_id for r in read_transfers(p)] == ["t1"]
    p.write_text(p.read_text() + 'uest_id":"p2","bytes":-4}\n')
    with pytest.raises(TraceError, match="line 2.*bytes"):
        read_transfers(p)
    with pytest.raises(TraceError, match="src_port"):
        TraceWriter(tmp_path / "x.jsonl").write(TransferRecord("t", "p", src_port=70000))
    with pytest.raises(TraceError, match="cannot read"):
        read_transfers(tmp_path / "missing.jsonl")


def test_a_none_path_writes_nothing():
    w = TraceWriter(None)
    w.write(TransferRecord("t", "p"))
    assert w.path is None and w.count == 0
    w.close()


def test_an_empty_path_writes_nothing_and_odd_lines_are_trace_errors(tmp_path):
    w = TraceWriter("")  # a knob set to "" means no log, as None does
    w.write(TransferRecord("t", "p"))
    assert w.path is None and w.count == 0
    p = tmp_path / "log.jsonl"
    for bad in (b'{"type":"transfer","transfer_id":"\xff\xfe","request_id":"p"}\n',  # not UTF-8
                b'"kind"\n',  # a bare string that looks like a 0.1 record
                b"[" * 100_000 + b"\n"):  # deeper than any decoder goes
        p.write_bytes(bad)
        with pytest.raises(TraceError, match="line 1"):
            read_transfers(p)
