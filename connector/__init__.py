"""kvpath's KV connector: pushes KV from prefill to decode over NIXL lanes.

vLLM finds ``KVPathConnector`` by its short name through the ``vllm.general_plugins``
entry point (:mod:`kvpath.connector.plugin`); ``kv_connector_module_path:
"kvpath.connector"`` works too. The transfer engine (``sender``, ``receiver``) does not
import vLLM, and the adapter is imported lazily so that importing the engine never
pulls vLLM in.
"""

from typing import Any

__all__ = ["KVPathConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPathConnector":
        from kvpath.connector.vllm_connector import KVPathConnector

        return KVPathConnector
    raise AttributeError(f"module 'kvpath.connector' has no attribute {name!r}")
