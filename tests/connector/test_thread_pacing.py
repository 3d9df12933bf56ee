"""How long the writer (P) and the receiver (D) threads sleep per step: dormant with
nothing held, the idle pace while something is or was just held, never a busy loop
for a WRITE that is stuck."""

import time

import numpy as np
import pytest

from kvpath.connector.config import KVPathConfig
from kvpath.connector.engine_thread import DORMANT_POLL_MS, LINGER_S
from kvpath.connector.layer_progress import LayerProgress
from kvpath.connector.layout import layout_from_buffers
from kvpath.connector.receiver import PushReceiver
from kvpath.connector.sender import PushSender
from kvpath.connector.write_loop import InFlight

CFG = KVPathConfig(control_plaintext=True, idle_poll_s=0.02)
IDLE_MS = int(CFG.idle_poll_s * 1000)


@pytest.fixture
def buffers():
    buf = np.zeros(16 * 1024, dtype=np.uint8)
    spans = [(buf.ctypes.data, buf.nbytes)]
    return buf, spans, layout_from_buffers(spans, 16, 16)


def _timeouts(thread, steps=1):
    got = []

    def poll(timeout_ms):
        got.append(timeout_ms)
        return None  # as if the sockets closed: the step ends right after its poll

    thread.poll_events = poll
    for _ in range(steps):
        thread.step()
    return got


def test_writer_sleeps_dormant_idle_or_spins_as_its_work_needs(buffers):
    _, spans, lay = buffers
    s = PushSender(CFG, lay, spans)
    try:
        s.active_until = 0.0
        assert _timeouts(s) == [DORMANT_POLL_MS]  # nothing held, nothing recent
        s.writes.in_flight["t"] = InFlight(None, 0, None, [(None, 0)], None, slow_at=time.monotonic() + 30)
        assert _timeouts(s) == [0]  # a WRITE moving: progressed without pause
        s.writes.in_flight["t"].slow = True
        assert _timeouts(s) == [1]  # a stuck WRITE: every millisecond, not a busy loop
        s.writes.in_flight["t"].handles.clear()
        # a layer-wise push waiting for its prefill: the idle pace (commands wake the writer)...
        assert _timeouts(s) == [IDLE_MS]
        lp = LayerProgress(layers=4, forward=1)
        s.forwards.begin(lp)
        assert _timeouts(s) == [1]  # ...every millisecond while a begun forward reports its layers
        s.forwards.forget(lp)
        s.writes.in_flight.clear()
        assert _timeouts(s) == [IDLE_MS]  # just held: the idle pace for LINGER_S
        s.active_until = time.monotonic() - 0.001
        assert _timeouts(s) == [DORMANT_POLL_MS]
    finally:
        s.close()


def test_receiver_lingers_then_goes_dormant_and_is_fast_during_a_handshake(buffers, monkeypatch):
    _, spans, lay = buffers
    r = PushReceiver(CFG, lay, spans)
    try:
        r.active_until = 0.0
        assert _timeouts(r) == [DORMANT_POLL_MS]
        # something held (a registration not yet sent): fast; then the idle pace for LINGER_S
        r.state.add("r1", "t1", "127.0.0.1:1")
        assert _timeouts(r) == [1]
        r.state.by_tid.clear()
        assert _timeouts(r) == [IDLE_MS]
        assert r.active_until > time.monotonic() + LINGER_S / 2
        r.active_until = 0.0
        # a Hello just sent, no Welcome yet: P may be probing its lanes into us
        monkeypatch.setattr(r.links, "handshaking", lambda now: True)
        assert _timeouts(r) == [1]
        monkeypatch.setattr(r.links, "handshaking", lambda now: False)
        r.active_until = 0.0
        assert _timeouts(r) == [DORMANT_POLL_MS]
    finally:
        r.close()


def test_an_unanswered_hello_counts_as_a_handshake_for_two_heartbeats_only(buffers):
    from kvpath.connector.peer_links import PeerLink

    _, spans, lay = buffers
    r = PushReceiver(CFG, lay, spans)
    try:
        now = time.monotonic()
        r.links.by_addr["p:1"] = PeerLink("p:1", None, hello_at=now - 0.1)
        assert r.links.handshaking(now)
        r.links.by_addr["p:1"].hello_at = now - 2.5 * CFG.heartbeat_s()  # P never answered: stop counting it
        assert not r.links.handshaking(now)
        r.links.by_addr["p:1"].hello_at, r.links.by_addr["p:1"].welcomed = now, True
        assert not r.links.handshaking(now)
    finally:
        r.links.by_addr.clear()
        r.close()
