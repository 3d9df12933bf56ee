"""The connector's per-request params refuse ids it could neither log nor send, and its
engine threads write log records without letting a failed write skip what follows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpath.connector.engine_thread import EngineThread
from kvpath.connector.params import BadTransferParams, parse_decode, parse_prefill
from kvpath.connector.telemetry import Stats
from kvpath.trace import TraceError, TransferRecord

ROOT = Path(__file__).resolve().parents[1]
LONE_SURROGATE = "t-\ud800"  # valid in json.loads, refused by every UTF-8 encoder


@pytest.mark.parametrize("tid", [LONE_SURROGATE, "", "x" * 257, 7])
def test_prefill_and_decode_params_refuse_ids_that_cannot_be_written(tid):
    with pytest.raises(BadTransferParams, match="transfer_id"):
        parse_prefill({"do_remote_decode": True, "kvpath": {"transfer_id": tid}}, "req-1")
    with pytest.raises(BadTransferParams, match="transfer_id"):
        parse_decode({"do_remote_prefill": True, "kvpath": {"transfer_id": tid, "peer": "127.0.0.1:5600"}})


def test_a_lease_id_that_cannot_be_written_is_refused_and_good_params_pass():
    with pytest.raises(BadTransferParams, match="lease_id"):
        parse_prefill({"do_remote_decode": True, "kvpath": {"transfer_id": "t", "lease_id": LONE_SURROGATE}}, "r")
    p = parse_prefill({"do_remote_decode": True, "kvpath": {"transfer_id": "t-é", "lane": 2, "lease_id": "r7"}}, "r")
    assert (p.transfer_id, p.lane, p.lease_id) == ("t-é", 2, "r7")


def test_a_transfer_key_travels_in_both_legs_and_a_bad_one_is_refused_naming_it():
    from kvpath.connector.params import decode_leg_params, new_transfer_key, prefill_leg_params

    key = new_transfer_key()
    assert parse_prefill(prefill_leg_params("t", transfer_key=key), "r").transfer_key == key
    assert parse_decode(decode_leg_params("t", "127.0.0.1:5600", transfer_key=key)).transfer_key == key
    assert parse_prefill(prefill_leg_params("t"), "r").transfer_key == ""  # optional
    for bad in ("short", 5, "x" * 129, "bad key with \n newline....."):
        with pytest.raises(BadTransferParams, match="transfer_key"):
            parse_prefill({"do_remote_decode": True, "kvpath": {"transfer_id": "t", "transfer_key": bad}}, "r")


class _Failing:
    def __init__(self, exc: Exception):
        self.exc, self.calls = exc, 0

    def write(self, rec: object) -> None:
        self.calls += 1
        raise self.exc


class _Thread:
    """What EngineThread._record touches: its log, its counters and its TP rank."""

    def __init__(self, trace: object):
        self.trace, self.stats, self.rank = trace, Stats(), 1


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "x"),
                                 TraceError("bad record")])
def test_a_record_that_cannot_be_written_is_counted_not_raised(exc):
    t = _Thread(_Failing(exc))
    rec = TransferRecord("tid", "rid")
    EngineThread._record(t, rec)  # type: ignore[arg-type]
    assert t.trace.calls == 1 and t.stats.snapshot()["trace_write_failed"] == 1
    assert (rec.rank, rec.peer_rank) == (1, 1)  # the writer's rank, and D's (equal ranks are paired)


def test_engine_threads_write_their_log_only_through_the_non_raising_helper():
    """A direct ``self.trace.write`` in a writer/receiver loop would let one bad record skip
    the releases after it (the bug this guards against)."""
    direct = []
    for path in sorted((ROOT / "connector").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "write" and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "trace" and path.name != "engine_thread.py"):
                direct.append(f"{path.name}:{node.lineno}")
    assert direct == []
