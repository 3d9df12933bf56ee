"""Size-based rotation of an append-only log that several processes may share.

``path`` is renamed to ``path.1`` (``path.1`` to ``path.2`` ..., the oldest beyond
``keep`` dropped) once it reaches ``max_bytes``, and writers reopen ``path``. The
processes that append to one log (P's TP workers) agree through an ``flock`` on
``path.lock``, and only a writer whose open file still is ``path`` rotates it: one that
finds ``path`` already rotated by another process only reopens it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


def rotated(path: Path, i: int) -> Path:
    return path.with_name(f"{path.name}.{i}")


def rotate_if_full(path: Path, fh: IO[bytes], max_bytes: int, keep: int) -> IO[bytes]:
    """The file to append to from now on: ``fh`` itself while ``path`` is under
    ``max_bytes``, else a new file at ``path`` (the old one rotated, by us or by
    another process). Raises OSError when the log's directory cannot be changed."""
    own = os.fstat(fh.fileno())
    if own.st_size < max_bytes:
        return fh
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cur = os.stat(path)
        except FileNotFoundError:
            cur = None
        if cur is not None and (cur.st_dev, cur.st_ino) == (own.st_dev, own.st_ino) and cur.st_size >= max_bytes:
            for i in range(keep - 1, 0, -1):
                if rotated(path, i).exists():
                    os.replace(rotated(path, i), rotated(path, i + 1))
            if keep > 0:
                os.replace(path, rotated(path, 1))
            else:
                os.unlink(path)
        new = open(path, "ab", buffering=0)
    finally:
        os.close(lock)  # releases the flock
    fh.close()
    return new


def log_files(path: Path) -> list[Path]:
    """``path``'s rotated files, oldest first, then ``path`` itself (when they exist)."""
    old = []
    i = 1
    while rotated(path, i).exists():
        old.append(rotated(path, i))
        i += 1
    return [*reversed(old), *([path] if path.exists() else [])]
