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


def test_a_writer_thread_is_watched_while_it_runs():
    """A real writer (P's engine thread, no vLLM) joins the process's watcher when it
    starts; its steps are marked (its thread waits in a step's poll nearly all the
    time); closed, it is no step and no longer alive."""
    from kvpath.connector.config import KVPathConfig
    from kvpath.connector.layout import layout_from_buffers
    from kvpath.connector.sender import PushSender
    from kvpath.testbed.peer_process import BufferSpec, make_buffers
    from kvpath.testbed.readiness import free_port

    spec = BufferSpec(regions=2, num_blocks=8, block_len=1024, block_size=16)
    bufs = make_buffers(spec, "random", seed=1)
    spans = [(b.ctypes.data, b.nbytes) for b in bufs]
    cfg = KVPathConfig(side_channel_port=free_port(), ucx_net_devices="lo", control_plaintext=True)
    p = PushSender(cfg, layout_from_buffers(spans, spec.num_blocks, spec.block_size), spans).start()
    try:
        assert p.alive() and p in StallWatch.shared().watching() and StallWatch.shared().running()
        deadline = time.monotonic() + 10
        while p.step_started_at() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.step_started_at() is not None and "sender" in p.thread_name()
    finally:
        p.close()
    assert not p.alive() and p.step_started_at() is None


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
    # held here: the watcher keeps its items weakly (a closed connector leaves it), and an
    # item nobody held could go before running() is asked (seen once in CI)
    item = Item(t, started=None)
    try:
        watch.add(item)
        assert watch.running()
    finally:
        release.set()  # never leave a thread that keeps the test process from exiting
    t.join()
    deadline = time.monotonic() + 10
    while watch.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not watch.running()
