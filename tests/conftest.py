import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The parts install under kvpath.* (package-dir); their folders must never be imported under
# their old top-level names, which `python -m pytest` from the root would allow.
OLD_TOP_LEVEL = ("connector", "proxy", "testbed", "simulator_bridge")
# Pushes in tests must cross a TCP connection on loopback (one per lane).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def keys_dir(tmp_path_factory) -> Path:
    """A folder for a prefill and a decode key pair (``connector_config(keys_dir=...)``)."""
    return tmp_path_factory.mktemp("pd-keys")


def _old_names_imported() -> list[str]:
    bad = []
    for name in OLD_TOP_LEVEL:
        mod = sys.modules.get(name)
        origin = str(getattr(mod, "__file__", None) or "") if mod is not None else ""
        if origin.startswith(str(ROOT)):  # another distribution's `proxy` is not ours to judge
            bad.append(f"{name} ({origin})")
    return bad


@pytest.fixture(autouse=True)
def _no_old_top_level_names():
    """Fails the test during which a part was imported under its old name."""
    yield
    bad = _old_names_imported()
    if bad:
        pytest.fail(f"imported under an old top-level name (use kvpath.*): {', '.join(bad)}")


def pytest_collection_finish(session: pytest.Session) -> None:
    bad = _old_names_imported()
    if bad:
        raise pytest.UsageError(f"a test module imports an old top-level name (use kvpath.*): {', '.join(bad)}")


@pytest.fixture(autouse=True)
def _close_bare_engine_threads():
    """Engine threads a test built without starting (tests/connector/engine_doubles.py) hold a ZMQ
    context each: closed after the test."""
    yield
    doubles = sys.modules.get("tests.connector.engine_doubles")
    if doubles is not None:
        doubles.close_made()
