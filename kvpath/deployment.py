"""How a P/D deployment is named: pool sizes written ``NPmD`` and the KV side channel's
default port. Every part reads and writes them through here."""

from __future__ import annotations

import re

# KVPathConnector's side channel listens here unless configured otherwise (NIXL's
# VLLM_NIXL_SIDE_CHANNEL_PORT in pull mode too); imported flows default to it.
KV_SIDE_CHANNEL_PORT = 5600

_POOLS = re.compile(r"(\d+)P(\d+)D")


def parse_pools(text: str) -> tuple[int, int]:
    """``"8P8D"`` -> ``(8, 8)``; a ValueError naming the format otherwise (also for 0 P or 0 D)."""
    m = _POOLS.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"pools must look like 8P8D (prefill instances, then decode instances), got {text!r}")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError(f"pools needs at least one prefill and one decode instance, got {text!r}")
    return p, d


def format_pools(prefill: int, decode: int) -> str:
    return f"{prefill}P{decode}D"
