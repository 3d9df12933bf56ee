import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Pushes in tests must cross a TCP connection on loopback (one per lane).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


import pytest  # noqa: E402


@pytest.fixture
def ns3_wheel() -> Path:
    """The ns3 wheel's install directory; skips where it is absent (scripts/setup.sh
    installs it, so only a hand-made environment lacks it)."""
    from simulator_bridge.ns3_backend import Ns3Error, ns3_root

    try:
        return ns3_root()
    except Ns3Error as e:  # pragma: no cover
        pytest.skip(f"ns3 wheel not installed: {e}")
