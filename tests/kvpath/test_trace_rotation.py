"""The connector's log is rotated by size and read back whole, also when two
processes append to it."""

import multiprocessing as mp

from kvpath.trace import ReceivedRecord, TraceWriter, read_connector_log
from kvpath.trace.rotation import log_files


def _rec(i: int) -> ReceivedRecord:
    return ReceivedRecord(transfer_id=f"t{i:06d}", request_id=f"r{i}", at=1.0 + i)


def _append(path, start, n, max_bytes, keep):
    w = TraceWriter(path, max_bytes=max_bytes, keep=keep)
    for i in range(start, start + n):
        w.write(_rec(i))
    w.close()


def test_a_log_is_rotated_at_its_size_and_keeps_that_many_files(tmp_path):
    path = tmp_path / "p.jsonl"
    _append(path, 0, 400, max_bytes=4096, keep=2)
    files = log_files(path)
    assert [f.name for f in files] == ["p.jsonl.2", "p.jsonl.1", "p.jsonl"]
    assert all(f.stat().st_size < 4096 + 400 for f in files)  # rotated at the first record past the size
    got = [r.transfer_id for r in read_connector_log(path).received]
    # the newest records, in order, none repeated; the oldest files were dropped
    assert got == [f"t{i:06d}" for i in range(400 - len(got), 400)] and 0 < len(got) < 400


def test_two_processes_appending_rotate_once_per_fill_and_lose_nothing_kept(tmp_path):
    path = tmp_path / "shared.jsonl"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append, args=(path, k * 1000, 300, 16384, 50)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    got = [r.transfer_id for r in read_connector_log(path).received]
    assert sorted(got) == sorted([f"t{i:06d}" for i in range(300)] + [f"t{i:06d}" for i in range(1000, 1300)])
    assert len(log_files(path)) > 2  # it did rotate
