"""One failure never strands the other releases, and the reservation notifier's
close never waits for its backlog."""

import socket
import threading

import pytest

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.push_state import FinishedPrefill, PendingRegistration
from tests.connector.engine_doubles import bare_sender
from kvpath.reservation.notifier import ReservationNotifier


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_a_failing_release_does_not_strand_the_other_expired_prefills_or_registrations():
    c = Clock()
    snd = bare_sender()
    snd.state.lease_s, snd.state.clock = 1.0, c
    freed = []

    def release(fp):
        if fp.transfer_id == "t0":
            raise OSError("disk full")
        freed.append(fp.transfer_id)

    snd.freed.release = release
    for i in range(3):
        snd.state.add_prefill(FinishedPrefill(f"r{i}", f"t{i}", [i]))
    snd.state.registrations["u"] = PendingRegistration(M.Register("u", "d", "a", [1]), b"d", post_by=c.t + 0.5)
    c.t += 5
    snd.writes.expire()
    acks = [(m.transfer_id, m.status) for _, m in snd.channel.router.out]
    assert freed == ["t1", "t2"] and acks == [("u", "expired")]
    assert snd.stats.totals["engine_thread_errors"] == 1


def test_notifier_close_stops_its_threads_without_working_off_the_backlog():
    # a service that accepts connections and never answers: every call waits its timeout
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    n = ReservationNotifier(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.3)
    try:
        # Fill the queue (10,000): its one thread takes at most one call per 0.3 s, so
        # a bounded loop gets it full however slow the machine is.
        for i in range(20000):
            if n._q.full():
                break
            n.release(f"lease-{i}")
        else:
            pytest.fail("20,000 releases did not fill a queue of 10,000")
        before = n.stats.totals.get("reservation_calls_failed", 0)
        for i in range(10):
            n.release(f"one too many {i}")  # dropped and counted, never blocks
        # the thread can free at most one slot per call it finishes (0.3 s each)
        assert n.stats.totals["reservation_calls_failed"] - before >= 8
        n.close()
        for t in n._threads:  # each ends after the call it was in (0.3 s), not after 10,000 of them
            t.join(10)
        assert not any(t.is_alive() for t in n._threads), "a thread is still working off 10,000 calls"
    finally:
        stop.set()
        srv.close()
        for s in held:
            s.close()


class _Agent:
    def __init__(self):
        self.deregistered = []

    def deregister_memory(self, reg):
        self.deregistered.append(reg)


def _thread_that_blocks(stuck: threading.Event):
    import numpy as np

    from kvpath.connector.engine_thread import EngineThread
    from kvpath.connector.layout import layout_from_buffers

    class Stuck(EngineThread):
        """An engine thread whose loop blocks (as in a NIXL call) until ``stuck`` is set."""

        def __init__(self, agent):
            buf = np.zeros(4096, dtype=np.uint8)
            spans = [(buf.ctypes.data, buf.nbytes)]
            super().__init__(KVPathConfig(control_plaintext=True), layout_from_buffers(spans, 4, 16), spans, "e", 0,
                             None, None, "x")
            self._nixl_regs.append((agent, "reg"))
            self._start_thread(lambda: stuck.wait(30), "stuck-thread")

        def sockets_closed(self) -> bool:
            return self._wake_rx.closed

        def join(self, timeout: float) -> None:
            self._thread.join(timeout)

    agent = _Agent()
    return Stuck(agent), agent


def test_close_never_closes_sockets_or_agents_under_a_thread_that_did_not_stop(monkeypatch):
    from kvpath.connector.engine_thread import EngineThread

    monkeypatch.setattr(EngineThread, "STOP_TIMEOUT_S", 0.2)
    stuck = threading.Event()
    t, agent = _thread_that_blocks(stuck)
    try:
        assert t.close() is False
        assert not t.sockets_closed() and agent.deregistered == []
    finally:
        stuck.set()
        t.join(5)
    assert t.close() is True  # once it stopped: sockets closed, memory deregistered
    assert t.sockets_closed() and agent.deregistered == ["reg"]


def test_engine_threads_never_closed_are_collected_without_hanging_and_free_their_sockets():
    """An engine thread that nobody closes (a start that raised, a test that failed half
    way) is freed by the cycle collector. Its ZMQ sockets must be closed before its
    context, or the context's term blocks the process for good (seen: the suite hung in
    an unrelated test). Run in a child process, so that a hang fails this test only."""
    import subprocess
    import sys

    code = (
        "import gc, os\n"
        "from kvpath.connector import messages as M\n"
        "from kvpath.connector.config import KVPathConfig\n"
        "from kvpath.connector.receiver import PushReceiver\n"
        "from kvpath.connector.sender import PushSender\n"
        "lay = M.BlockLayout([M.Region(4096, 64, 64)], 16, 16)\n"
        "gc.collect(); base = len(os.listdir('/proc/self/fd'))\n"
        "for _ in range(20):\n"
        "    s = PushSender(KVPathConfig(control_plaintext=True), lay, spans=[])\n"
        "    r = PushReceiver(KVPathConfig(control_plaintext=True), lay, spans=[])\n"
        "    del s, r\n"
        "gc.collect()\n"
        "print(len(os.listdir('/proc/self/fd')) - base)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("collecting unclosed engine threads hung (a ZMQ context's term with sockets open)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) <= 0  # every socket and context released
