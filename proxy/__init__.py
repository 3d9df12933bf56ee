"""kvpath.proxy: the OpenAI-compatible P/D proxy (FastAPI). The path reservation service is kvpath.reservation.

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
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpath.proxy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
