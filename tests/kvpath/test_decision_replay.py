"""Replaying a reservation service's decision log through the decision code."""

import random

import pytest

from kvpath.reservation.decisions import ReservationService
from kvpath.reservation.replay import ReplayError, replay
from kvpath.reservation.wire import METRICS
from tests.kvpath.test_reservation import SPEC, Clock, _sequence


def _logged(mode: str, seed: int = 9, **kw) -> list[dict]:
    clock = Clock()
    svc = ReservationService(SPEC, mode, clock=clock, **kw)
    _sequence(svc, clock, random.Random(seed))
    return list(svc.decisions)


@pytest.mark.parametrize("metric", METRICS)
def test_a_cc_log_replays_to_the_same_decisions_as_cc_and_as_dc_with_zero_delay(metric):
    log = _logged("cc", metric=metric)
    assert len(log) > 100 and sum(bool(d.get("end_seq")) for d in log) > len(log) // 2  # most leases ended
    for mode in ("cc", "dc"):
        r = replay(log, SPEC, mode, 0.0, metric)
        assert (r.decisions, r.same_lane, r.differing) == (len(log), len(log), [])


def test_replay_sees_a_mode_that_decides_otherwise():
    log = _logged("cc")
    r = replay(log, SPEC, "ecmp")  # the hash's lane, blind to load
    assert r.same_lane < r.decisions and r.differing
    # and an ecmp log is reproduced by ecmp
    e = _logged("ecmp")
    assert replay(e, SPEC, "ecmp").same_lane == len(e)


def test_replay_needs_the_candidates():
    log = _logged("cc")
    log[3] = {k: v for k, v in log[3].items() if k != "candidates"}
    with pytest.raises(ReplayError, match="candidates"):
        replay(log, SPEC, "cc")
