"""Copies of pushed KV, for checking what landed against what was sent (the
``kv_dump_dir`` knob; docs/connector-verify.md, "Checking the bytes (kv_dump_dir)").

P writes the blocks it pushed from, D the blocks the push landed in, once all of a
request's flows into that D rank have landed: one ``.npz`` per side, transfer and
rank, named by :func:`dump_path`. Each holds ``kv`` (uint8, ``[region, block,
block_len]``), the rank's ``heads``, ``block_size`` and ``skip_blocks`` (D's prefix
hits, not written). A debugging aid: it copies every pushed byte, so it stops after
MAX_DUMPS files per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvpath.connector.messages import BlockLayout, Compat
from kvpath.connector.tp_map import heads_of

logger = logging.getLogger(__name__)

MAX_DUMPS = 256


def dump_path(directory: str | Path, side: str, transfer_id: str, rank: int) -> Path:
    """Where ``side`` ("p" or "d") rank ``rank`` dumps ``transfer_id`` (a peer's string:
    hashed, never a path of its own)."""
    digest = hashlib.sha256(transfer_id.encode("utf-8", "replace")).hexdigest()[:20]
    return Path(directory) / f"{side}-{digest}-r{rank}.npz"


def read_blocks(layout: BlockLayout, block_ids: Sequence[int]) -> np.ndarray:
    """The bytes of ``block_ids`` in every region, ``[region, block, block_len]``."""
    blen = max((r.block_len for r in layout.regions), default=0)
    out = np.zeros((len(layout.regions), len(block_ids), blen), dtype=np.uint8)
    for i, r in enumerate(layout.regions):
        for j, b in enumerate(block_ids):
            if not 0 <= b < layout.num_blocks:
                raise ValueError(f"block {b} outside the {layout.num_blocks} blocks")
            src = (ctypes.c_uint8 * r.block_len).from_address(r.base + b * r.block_stride)
            out[i, j, : r.block_len] = np.ctypeslib.as_array(src)
    return out


class KVDump:
    def __init__(self, directory: str, side: str, rank: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.side, self.rank = side, rank
        self.written = 0

    def write(self, transfer_id: str, layout: BlockLayout, compat: Compat, block_ids: Sequence[int],
              skip_blocks: int = 0) -> None:
        """Copy and save at once. Never raises: a dump must not fail a push."""
        self.save(self.copy(transfer_id, layout, compat, block_ids, skip_blocks))

    def copy(self, transfer_id: str, layout: BlockLayout, compat: Compat, block_ids: Sequence[int],
             skip_blocks: int = 0) -> tuple[str, dict[str, Any]] | None:
        """The blocks' bytes now (while the caller keeps them from being reused), to be
        written by ``save`` later; None past MAX_DUMPS or for a cache not in DRAM (a VRAM
        region's base is a device pointer). Never raises."""
        if layout.mem_type != "DRAM":
            if self.written == 0:
                logger.warning("kv_dump_dir: the KV cache is in %s, not DRAM: nothing is dumped", layout.mem_type)
            self.written = MAX_DUMPS + 1
            return None
        if self.written >= MAX_DUMPS:
            if self.written == MAX_DUMPS:
                logger.warning("kv_dump_dir: %d dumps written, no more from this process", MAX_DUMPS)
                self.written += 1
            return None
        try:
            heads = heads_of(compat.tp_size, compat.tp_rank, compat.kv_heads) if compat.kv_heads else []
            self.written += 1
            return transfer_id, {"kv": read_blocks(layout, block_ids), "heads": np.asarray(heads, dtype=np.int64),
                                 "block_size": layout.block_size, "skip_blocks": skip_blocks}
        except Exception:
            logger.exception("kv_dump_dir: copying %s failed", transfer_id)
            return None

    def save(self, copied: tuple[str, dict[str, Any]] | None) -> None:
        """Write what ``copy`` took. Never raises."""
        if copied is None:
            return
        transfer_id, arrays = copied
        try:
            np.savez(dump_path(self.directory, self.side, transfer_id, self.rank), **arrays)
        except Exception:
            logger.exception("kv_dump_dir: dumping %s failed", transfer_id)
