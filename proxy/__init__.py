"""kvpath.proxy: the OpenAI-compatible P/D proxy and the path reservation service (FastAPI).

The public names load on first use, so importing the package (or its light modules,
e.g. :mod:`kvpath.proxy.config`) pulls in neither FastAPI nor aiohttp.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "TRANSFER_ID_HEADER": "kvpath.proxy.config",
    "ProxyConfig": "kvpath.proxy.config",
    "Proxy": "kvpath.proxy.core",
    "create_app": "kvpath.proxy.app",
    "HttpReserver": "kvpath.proxy.reservation_client",
    "InProcessReserver": "kvpath.proxy.reservation_client",
    "create_reservation_app": "kvpath.proxy.reservation_app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpath.proxy' has no attribute {name!r}")
    attr = "create_app" if name == "create_reservation_app" else name
    return getattr(importlib.import_module(module), attr)
