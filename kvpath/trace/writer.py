"""Writing trace records: :class:`TraceWriter`, one validated JSON line per record.

A run's trace is written once, header first. A connector's log is appended to by every
process and thread of a connector through its own :class:`TraceWriter` (each record one
``write()`` of a whole line), and rotated when full (:mod:`kvpath.trace.rotation`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import IO, Iterable

import msgspec

from kvpath.trace.records import Header, Record, TraceError, validate
from kvpath.trace.rotation import rotate_if_full

__all__ = ["TraceWriter"]

_encoder = msgspec.json.Encoder()


class TraceWriter:
    """Writes trace records, each validated, one JSON line each; safe from several threads.

    With a header: a run's trace, the file truncated and the header written first.
    Without one: a connector's log, appended to (several processes may share the file);
    ``{pid}`` in the path becomes this process's id, and ``max_bytes`` rotates it
    (:mod:`kvpath.trace.rotation`, ``keep`` old files). A ``None`` path writes nothing."""

    def __init__(self, path: str | Path | None, header: Header | None = None, max_bytes: int | None = None,
                 keep: int = 3):
        self._lock = threading.Lock()
        self._fh: IO[bytes] | None = None
        self.count = 0
        self.path: Path | None = None
        self._max_bytes = max_bytes if header is None else None  # a run's trace is one file
        self._keep = keep
        if path is None or str(path) == "":
            return
        if header is not None:
            validate(header)
        self.path = Path(str(path).replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if header is None:
            # unbuffered: each record is one write() of one whole line, so concurrent
            # appenders (P's TP workers, a reader polling) never see half a line
            self._fh = open(self.path, "ab", buffering=0)
        else:
            self._fh = open(self.path, "wb")
            self._fh.write(_encoder.encode(header) + b"\n")

    def write(self, rec: Record) -> None:
        if self._fh is None:
            return
        if isinstance(rec, Header):
            raise TraceError("header: written once, by TraceWriter(path, header)")
        validate(rec)
        line = _encoder.encode(rec) + b"\n"
        with self._lock:
            if self._fh is not None:
                view = memoryview(line)
                while view:  # an unbuffered write may be short (a nearly full disk): finish the line
                    n = self._fh.write(view)
                    if not n:
                        raise OSError(f"{self.path}: no progress writing a trace record")
                    view = view[n:]
                self.count += 1
                if self._max_bytes is not None and self.path is not None:
                    try:
                        self._fh = rotate_if_full(self.path, self._fh, self._max_bytes, self._keep)
                    except OSError as e:  # the record is written; rotation stops, once, loudly
                        self._max_bytes = None
                        logging.getLogger(__name__).error("%s: cannot rotate (%s); appending from now on",
                                                          self.path, e)

    def write_all(self, recs: Iterable[Record]) -> None:
        for r in recs:
            self.write(r)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
