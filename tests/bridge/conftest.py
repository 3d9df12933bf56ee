"""Fixtures the simulator bridge's tests share."""

from pathlib import Path

import pytest


@pytest.fixture
def ns3_wheel() -> Path:
    """The ns3 wheel's install directory; skips where it is absent (scripts/setup.sh
    installs it, so only a hand-made environment lacks it)."""
    from kvpath.bridge.ns3_backend import Ns3Error, ns3_root

    try:
        return ns3_root()
    except Ns3Error as e:  # pragma: no cover
        pytest.skip(f"ns3 wheel not installed: {e}")
