"""Where a P/D request's time went: the timeline joined from P's and D's connector
records (vLLM's own times included), and the testbed run's TTFT breakdown."""

from rich.console import Console

from kvpath.request_timeline import Timeline, request_timelines
from kvpath.testbed.run_report import ttft_breakdown
from kvpath.trace import ConnectorLog, ReceivedRecord, TransferRecord


def _log():
    t = 1000.0
    p = [TransferRecord("t1", "p-1", peer_request_id="cmpl-abc-0-x", p_arrival_at=t, p_queued_at=t + 0.001,
                        p_scheduled_at=t + 0.003, registered_at=t + 0.002, prefill_done_at=t + 0.043,
                        submit_at=t + 0.044, completed_at=t + 0.046, rank=0, peer_rank=0),
         # TP > 1: a second flow of the same transfer is not a second request
         TransferRecord("t1", "p-1", peer_request_id="cmpl-abc-0-x", submit_at=t + 0.044, completed_at=t + 0.050,
                        rank=1, peer_rank=0),
         TransferRecord("t2", "p-2", peer_request_id="cmpl-def-0-y", status="expired")]
    d = [ReceivedRecord(transfer_id="t1", request_id="cmpl-abc-0-x", at=t + 0.047)]
    return ConnectorLog(p, [], []), ConnectorLog([], d, [])


def test_the_timeline_joins_ps_and_ds_records_one_per_request():
    p, d = _log()
    lines = request_timelines(p, d)
    assert [tl.transfer_id for tl in lines] == ["t1", "t2"]
    tl = lines[0]
    tl.client_sent_at, tl.client_first_at = 999.995, 1000.060
    parts = {k: round(v * 1e3, 3) if v is not None else None for k, v in tl.parts().items()}
    assert parts == {"to P": 5.0, "P queue": 3.0, "P prefill": 40.0, "wait D": 1.0, "push": 2.0, "D sees": 1.0,
                     "D 1st tok": 13.0}
    assert lines[1].push_s is None and lines[1].status == "expired"
    assert lines[0].d_request_id.startswith("cmpl-abc")  # what a client's response id names


def test_the_timeline_table_fits_80_columns_with_a_median_row():
    p, d = _log()
    lines = request_timelines(p, d)
    con = Console(width=80, record=True)
    con.print(Timeline.table(lines, "where the time went (ms)"))
    out = con.export_text()
    assert "…" not in out and "median" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_the_run_breakdown_is_the_median_of_each_part_where_both_ends_are_known():
    rows = [{"arrival": 0.0, "p_arrival": 0.002, "prefill_start": 0.005, "prefill_end": 0.045, "push_start": 0.046,
             "push_end": 0.050, "first_token": 0.060},
            {"arrival": 1.0, "p_arrival": 1.004, "prefill_start": 1.005, "prefill_end": 1.065, "push_start": 1.065,
             "push_end": 1.075, "first_token": 1.080},
            {"arrival": 2.0, "prefill_start": None, "first_token": 2.1}]  # a real engine's row: no server times
    b = ttft_breakdown(rows, scale=1e3)
    assert {k: round(v, 3) for k, v in b.items()} == {"front end": 3.0, "P queue": 2.0, "P prefill": 50.0,
                                                      "wait for D": 0.5, "push": 7.0, "D to 1st token": 7.5}
    assert ttft_breakdown([{"arrival": 0.0, "first_token": 1.0}]) == dict.fromkeys(b)
