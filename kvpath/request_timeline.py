"""Where a P/D request's time went, joined from the records the parts already keep:
P's connector (its ``TransferRecord``: vLLM's own arrival, queue and schedule times of
the P request, D's registration, the end of prefill, the push) and D's connector (its
``ReceivedRecord``: the push's last byte seen by D), plus the client's send and first
byte where a caller has them. No part takes a new clock for it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from rich import box
from rich.table import Table

from kvpath.trace import ConnectorLog, TransferRecord

# (column, start field, end field): each part of a P/D request, in order
PARTS: tuple[tuple[str, str, str], ...] = (
    ("to P", "client_sent_at", "p_arrival_at"),
    ("P queue", "p_arrival_at", "p_scheduled_at"),
    ("P prefill", "p_scheduled_at", "prefill_done_at"),
    ("wait D", "prefill_done_at", "submit_at"),
    ("push", "submit_at", "completed_at"),
    ("D sees", "completed_at", "d_received_at"),
    ("D 1st tok", "d_received_at", "client_first_at"),
)


def part_lengths(times: Sequence[float | None]) -> list[float | None]:
    """The lengths of the parts between consecutive ``times`` (None where either end is
    unknown). A part that starts before the part before it ended (a layer-wise push
    overlaps P's prefill) counts from that end, and one that ends before it counts 0:
    the parts never overlap, so they add up to the whole (the push's part is what it
    adds after P's prefill)."""
    out: list[float | None] = []
    reached: float | None = None  # the latest end so far
    for a, b in zip(times, times[1:]):
        if a is None or b is None:
            out.append(None)
            continue
        start = a if reached is None else max(a, reached)
        end = max(b, start)
        out.append(end - start)
        reached = end
    return out


# the table's headers, two lines each so that the table fits 80 columns
_HEADERS = {"to P": "to\nP", "P queue": "P\nqueue", "P prefill": "P\nprefill", "wait D": "wait\nD",
            "push": "push", "D sees": "D\nsees", "D 1st tok": "D 1st\ntoken"}


@dataclass
class Timeline:
    """One P/D request (its first flow at TP > 1). Unix seconds; None where unknown."""

    transfer_id: str
    p_request_id: str
    d_request_id: str
    status: str
    client_sent_at: float | None = None
    p_arrival_at: float | None = None
    p_scheduled_at: float | None = None
    registered_at: float | None = None
    prefill_done_at: float | None = None
    submit_at: float | None = None
    completed_at: float | None = None
    d_received_at: float | None = None
    client_first_at: float | None = None

    @property
    def push_s(self) -> float | None:
        return self.part("submit_at", "completed_at")

    def part(self, start: str, end: str) -> float | None:
        a, b = getattr(self, start), getattr(self, end)
        return None if a is None or b is None else b - a

    def parts(self) -> dict[str, float | None]:
        """Each part's length, never overlapping another (:func:`part_lengths`)."""
        times = [getattr(self, PARTS[0][1])] + [getattr(self, b) for _, _, b in PARTS]
        return dict(zip((name for name, _, _ in PARTS), part_lengths(times)))

    @staticmethod
    def table(lines: Sequence["Timeline"], title: str) -> Table:
        """One row per request and a median row: ms per part (80 columns)."""
        t = Table(title=title, box=box.SIMPLE_HEAD)
        t.add_column("request", no_wrap=True)
        for name, _, _ in PARTS:
            t.add_column(_HEADERS[name], justify="right", no_wrap=True)
        t.add_column("TTFT", justify="right", no_wrap=True)

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.0f}"

        for tl in lines:
            t.add_row(tl.transfer_id[:6], *(ms(v) for v in tl.parts().values()),
                      ms(tl.part("client_sent_at", "client_first_at")))
        if len(lines) > 1:
            ttft = [tl.part("client_sent_at", "client_first_at") for tl in lines]
            t.add_section()
            t.add_row("median", *(ms(v) for v in median_parts(lines).values()), ms(_median(ttft)))
        return t


def _median(vals: Sequence[float | None]) -> float | None:
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else None


def median_parts(lines: Sequence[Timeline]) -> dict[str, float | None]:
    """The median of each part (seconds) over the requests that have both its ends."""
    each = [tl.parts() for tl in lines]
    return {name: _median([p[name] for p in each]) for name, _, _ in PARTS}


def timeline_of(t: TransferRecord, d_received_at: float | None = None) -> Timeline:
    """One request's timeline from P's record of its push (and when D had its last byte)."""
    return Timeline(
        transfer_id=t.transfer_id, p_request_id=t.request_id, d_request_id=t.peer_request_id, status=t.status,
        p_arrival_at=t.p_arrival_at, p_scheduled_at=t.p_scheduled_at,
        registered_at=t.registered_at, prefill_done_at=t.prefill_done_at, submit_at=t.submit_at,
        completed_at=t.completed_at, d_received_at=d_received_at)


def request_timelines(p_log: ConnectorLog, d_log: ConnectorLog | None = None) -> list[Timeline]:
    """One timeline per transfer in P's log (file order), with D's receipt where D's log
    has it (the first flow's record of each side at TP > 1)."""
    got: dict[str, float] = {}
    for rec in d_log.received if d_log else []:
        got.setdefault(rec.transfer_id, rec.at)
    out: dict[str, Timeline] = {}
    for t in p_log.transfers:
        if t.transfer_id not in out:
            out[t.transfer_id] = timeline_of(t, got.get(t.transfer_id))
    return list(out.values())
