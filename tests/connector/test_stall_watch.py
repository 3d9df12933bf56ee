"""A connector thread stuck in one step is named, with where it is stuck."""

from __future__ import annotations

import logging
import threading
import time

from kvpath.connector.stall_watch import StallWatch


class Item:
    def __init__(self, thread: threading.Thread, started: float | None):
        self.thread, self.started = thread, started

    def step_started_at(self):
        return self.started

    def thread_ident(self):
        return self.thread.ident

    def thread_name(self):
        return self.thread.name

    def alive(self):
        return self.thread.is_alive()


def blocked_in_a_native_wait(release: threading.Event) -> None:
    release.wait()


def test_a_stuck_step_is_logged_once_with_its_stack_and_again_when_it_moves_on(caplog):
    release = threading.Event()
    t = threading.Thread(target=blocked_in_a_native_wait, args=(release,), name="kvpath-receiver-test")
    t.start()
    try:
        watch = StallWatch(stall_s=15.0, run_thread=False)
        stuck, fine = Item(t, started=100.0), Item(threading.current_thread(), started=None)
        watch.add(stuck)
        watch.add(fine)
        with caplog.at_level(logging.WARNING, logger="kvpath.connector.stall_watch"):
            assert watch.check(now=112.0) == []  # 12 s: not yet
            assert watch.check(now=116.0) == ["kvpath-receiver-test"]
            assert watch.check(now=130.0) == ["kvpath-receiver-test"]  # the same stall: once
        assert watch.reports == 1
        [msg] = [r.getMessage() for r in caplog.records]
        assert "kvpath-receiver-test has been in one step for 16.0s" in msg
        assert "blocked_in_a_native_wait" in msg and "release.wait()" in msg  # where it is stuck
        caplog.clear()
        stuck.started = None  # the step returned
        with caplog.at_level(logging.WARNING, logger="kvpath.connector.stall_watch"):
            assert watch.check(now=131.0) == []
        assert "moved on" in caplog.records[0].getMessage()
        stuck.started = 140.0  # a new stall later is reported again
        assert watch.check(now=160.0) == ["kvpath-receiver-test"] and watch.reports == 2
    finally:
        release.set()
        t.join()


def test_the_engine_thread_reports_its_step_to_the_watch():
    """EngineThread's loop marks each step's start, and clears it between steps."""
    from kvpath.connector.engine_thread import EngineThread

    seen = []
    entered, release = threading.Event(), threading.Event()
    et = EngineThread.__new__(EngineThread)  # only the loop's bookkeeping, no agent or sockets
    et._stop, et._thread, et._step_started, et.stats = threading.Event(), None, None, None

    def step():
        seen.append(et.step_started_at())
        entered.set()
        release.wait()
        et._stop.set()

    et._start_thread(lambda: et._loop(step), "kvpath-writer-test")
    assert entered.wait(10)
    assert et.step_started_at() is not None and et.thread_name() == "kvpath-writer-test"
    assert et in list(StallWatch.shared()._watched)
    release.set()
    et._thread.join(10)
    assert et.step_started_at() is None and seen[0] is not None


def test_a_process_frozen_by_a_native_call_holding_the_gil_dumps_every_stack():
    """No Python thread can run while a native call holds the GIL (the watcher neither):
    faulthandler's C timer, which the watcher keeps re-arming, writes the stacks; and
    SIGUSR1 writes them when asked."""
    import subprocess
    import sys

    code = """
import ctypes, threading, time
from kvpath.connector.stall_watch import StallWatch
class Item:
    def step_started_at(self): return None
    def thread_ident(self): return threading.get_ident()
    def thread_name(self): return "x"
    def alive(self): return True
item = Item()
w = StallWatch(frozen_s=1.0, period_s=0.1)
w.add(item)
time.sleep(0.5)
import os, signal, sys
def asked_here():
    os.kill(os.getpid(), signal.SIGUSR1)  # an operator's kill -USR1: every stack, now
asked_here()
sys.stderr.write("---\\n")
def frozen_here():
    ctypes.PyDLL(None).sleep(4)  # libc sleep with the GIL held
frozen_here()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    asked, frozen = r.stderr.split("---\n")
    assert "asked_here" in asked and "Timeout" not in asked, r.stderr
    assert "Timeout (0:00:01)!" in frozen and "frozen_here" in frozen, r.stderr


def test_the_watcher_stops_when_the_last_watched_thread_has_ended():
    """Nothing left to watch (every connector closed): its thread ends, and with it the
    frozen-process timer (faulthandler's is process-wide)."""
    release = threading.Event()
    t = threading.Thread(target=blocked_in_a_native_wait, args=(release,), name="kvpath-writer-test")
    t.start()
    watch = StallWatch(period_s=0.05)
    watch.add(Item(t, started=None))
    assert watch._thread is not None and watch._thread.is_alive()
    release.set()
    t.join()
    deadline = time.monotonic() + 10
    while watch._thread is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch._thread is None
