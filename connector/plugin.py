"""vLLM general plugin: registers ``KVPathConnector`` by its short name.

vLLM calls ``register`` in every process it starts (API server, EngineCore, workers)
through the ``vllm.general_plugins`` entry point. It imports only vLLM's factory, never
NIXL or ZMQ: the connector module itself is imported lazily by the factory when an
engine asks for ``"kv_connector": "KVPathConnector"``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVPathConnector"
CONNECTOR_MODULE = "kvpath.connector.vllm_connector"


def register() -> None:
    """Idempotent: a second call (vLLM loads plugins once per process, tests more) does nothing."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:  # register_connector raises on a repeat
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    logger.debug("registered %s from %s", CONNECTOR_NAME, CONNECTOR_MODULE)
