"""Say where a connector thread is stuck, and where the whole process is.

P's writer and D's receiver threads each finish a step within a few hundred
milliseconds (the longest, a kv_dump file write or NIXL loading a peer's metadata, take
seconds). A step that has not returned for ``STALL_S`` is stuck (a native call that does
not come back, a lock): one watcher thread per process logs the stuck thread's stack
once, and again when it moves on. A native call that holds the GIL freezes every Python
thread, the watcher too; for that case the watcher keeps ``faulthandler``'s C timer
armed, so a process whose watcher could not run for ``FROZEN_S`` (frozen; or stopped,
SIGSTOP, that long) writes every thread's stack to stderr (the engine's log). The timer
is cancelled when the last watched thread is gone.
``kill -USR1`` on an engine process with the connector does the same on demand
(``DUMP_SIGNAL``; a C handler, so it answers a frozen process too).
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

STALL_S = 15.0  # a step this long is stuck (the longest legitimate ones take seconds)
FROZEN_S = 60.0  # the watcher could not run this long (the process froze): the C timer dumps every stack
PERIOD_S = 2.0
DUMP_SIGNAL = signal.SIGUSR1  # vLLM handles neither SIGUSR1 nor SIGUSR2


def enable_dump_signal() -> None:
    """``DUMP_SIGNAL`` writes every thread's stack to stderr (the process's log). A
    diagnostic: a stderr without a file descriptor only loses it, never the engine."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError) as e:
        logger.info("no stack dump on SIGUSR1: %s", e)


class Watched(Protocol):
    def step_started_at(self) -> float | None: ...  # monotonic start of the running step, None between steps

    def thread_ident(self) -> int | None: ...

    def thread_name(self) -> str: ...

    def alive(self) -> bool: ...  # its thread runs


class StallWatch:
    """The process's one watcher (``StallWatch.shared()``): a registry of the
    connector's threads, held weakly so a closed connector leaves it."""

    _lock = threading.Lock()
    _shared: StallWatch | None = None

    def __init__(self, stall_s: float = STALL_S, frozen_s: float = FROZEN_S, period_s: float = PERIOD_S,
                 run_thread: bool = True):
        # run_thread False: nothing checks on its own (a test calls check() at chosen times)
        self.stall_s, self.frozen_s, self.period_s, self.run_thread = stall_s, frozen_s, period_s, run_thread
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._stuck: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # watched -> the stuck step's start
        self._thread: threading.Thread | None = None
        self.reports = 0  # stalls logged (tests read it)

    @classmethod
    def shared(cls) -> StallWatch:
        with cls._lock:
            if cls._shared is None:
                cls._shared = StallWatch()
            return cls._shared

    def add(self, item: Watched) -> None:
        with self._lock:
            self._watched.add(item)
            if self.run_thread and (self._thread is None or not self._thread.is_alive()):
                enable_dump_signal()
                self._thread = threading.Thread(target=self._run, name="kvpath-stall-watch", daemon=True)
                self._thread.start()

    def watching(self) -> list[Watched]:
        with self._lock:
            return list(self._watched)

    def running(self) -> bool:
        """Its thread runs (it ends with the last watched thread)."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        armed = True
        while True:
            with self._lock:
                if not any(w.alive() for w in self._watched):  # the last connector closed
                    self._thread = None
                    break
            if armed:
                try:  # re-armed every period: it fires only when this thread stood still FROZEN_S
                    faulthandler.dump_traceback_later(self.frozen_s, exit=False, file=sys.stderr)
                except (AttributeError, OSError, RuntimeError, ValueError) as e:
                    armed = False  # a stderr without a descriptor: the stall warnings still work
                    logger.info("no stack dump of a frozen process: %s", e)
            try:
                self.check(time.monotonic())
            except Exception:  # a diagnostic must not die quietly, nor take anything with it
                logger.exception("stall watch: check failed")
            time.sleep(self.period_s)
        if armed:
            faulthandler.cancel_dump_traceback_later()

    def check(self, now: float) -> list[str]:
        """Log each newly stuck thread's stack, and each stuck one that moved on.
        Returns the names of the threads stuck now."""
        with self._lock:
            items = list(self._watched)
        frames = sys._current_frames()
        stuck = []
        for item in items:
            started = item.step_started_at()
            if started is None or now - started < self.stall_s:
                if item in self._stuck:
                    logger.warning("%s moved on after a step of up to %.1fs", item.thread_name(),
                                   now - self._stuck.pop(item))
                continue
            stuck.append(item.thread_name())
            if self._stuck.get(item) == started:
                continue  # this stall is reported already
            self._stuck[item] = started
            self.reports += 1
            frame = frames.get(item.thread_ident() or -1)
            where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(no frame)\n"
            logger.warning("%s has been in one step for %.1fs (stuck?); it is at:\n%s",
                           item.thread_name(), now - started, where.rstrip())
        return stuck
