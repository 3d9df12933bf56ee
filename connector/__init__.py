"""kvpath's KV connector: push KV from prefill to decode over NIXL lanes.

The transfer engine (``connector.sender``, ``connector.receiver``) does not import
vLLM. vLLM loads the adapter with ``kv_connector_module_path: "connector"`` and
``kv_connector: "KVPathConnector"``; it is imported lazily so that importing the
engine never pulls vLLM in.
"""

from typing import Any

__all__ = ["KVPathConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPathConnector":
        from connector.vllm_connector import KVPathConnector

        return KVPathConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
