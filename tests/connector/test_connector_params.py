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

ROOT = Path(__file__).resolve().parents[2]
LONE_SURROGATE = "t-\ud800"  # valid in json.loads, refused by every UTF-8 encoder


@pytest.mark.parametrize("tid", [LONE_SURROGATE, "", "x" * 257, 7, "t\x001"])
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
    """What EngineThread.record touches: its log, its counters and its TP rank."""

    def __init__(self, trace: object):
        self.trace, self.stats, self.rank = trace, Stats(), 1


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "x"),
                                 TraceError("bad record")])
def test_a_record_that_cannot_be_written_is_counted_not_raised(exc):
    t = _Thread(_Failing(exc))
    rec = TransferRecord("tid", "rid")
    EngineThread.record(t, rec)  # type: ignore[arg-type]
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


def test_ps_tp_size_in_ds_params_is_checked():
    import pytest as _pytest

    from kvpath.connector.params import BadTransferParams, decode_leg_params, parse_decode

    assert parse_decode(decode_leg_params("t", "h:1", tp_size=4)).tp_size == 4
    for bad in ("2", -1, 1025, True, 2.0):
        params = decode_leg_params("t", "h:1")
        params["kvpath"]["tp_size"] = bad
        with _pytest.raises(BadTransferParams, match="kvpath.tp_size"):
            parse_decode(params)


def test_a_d_leg_whose_p_ranks_cannot_be_reached_fails_alone_not_the_engine():
    """P rank p is at the advertised port + p: a client's port near 65535 with a TP size
    would name a port that does not exist, and a huge TP size a link per rank. Either
    fails that request (refused, its blocks freed), never the engine's step."""
    from kvpath.connector.config import parse_host_port
    from kvpath.connector.step_commands import RecvReq, StepCommands
    from kvpath.connector.vllm_worker import MAX_FLOWS, KVPathWorker

    class Receiver:
        def __init__(self):
            self.registered, self.refused = [], []

        def register(self, rid, tid, peers, *a, **kw):
            for p in peers:
                parse_host_port(p, "peer")
            self.registered.append((rid, peers, kw["peer_ranks"]))

        def refuse(self, rid, why):
            self.refused.append((rid, why))

    w = KVPathWorker.__new__(KVPathWorker)
    w.receiver, w.sender, w.rank, w.tp_size, w.idle_wait_s = Receiver(), None, 0, 1, 0.0
    w.compat_fields = {"kv_heads": 128}
    w.process_metadata(StepCommands(registrations=[
        RecvReq("r1", "t1", "127.0.0.1:65535", [1], 0, p_tp_size=2),
        RecvReq("r2", "t2", "127.0.0.1:5600", [1], 0, p_tp_size=MAX_FLOWS * 2),
        RecvReq("r3", "t3", "127.0.0.1:5600", [1], 0, p_tp_size=2),
        RecvReq("r4", "t4", "127.0.0.1:5600", [1], 0, p_tp_size=3),  # 3 does not divide 128 heads
    ]))
    assert w.receiver.registered == [("r3", ["127.0.0.1:5600", "127.0.0.1:5601"], [0, 1])]
    assert [rid for rid, _ in w.receiver.refused] == ["r1", "r2", "r4"]
    assert "65536" in w.receiver.refused[0][1] and f"at most {MAX_FLOWS}" in w.receiver.refused[1][1]
