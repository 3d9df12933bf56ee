"""A push's NIXL descriptors, for the whole request or for a range of its layers.

The layout's regions are per layer (and per K/V half), in the order vLLM registered
the KV tensors, so layers ``[first, last)`` are a contiguous run of regions on both
sides. A layer range is planned by the same code as the whole push, on layouts that
hold only those regions: unequal TP sizes and block sizes, and GQA fan-out, work per
layer as they do per request, and the ranges of a push add up to its whole descriptors.
"""

from __future__ import annotations

from typing import Callable

import msgspec
import numpy as np

from kvpath.connector import messages as M
from kvpath.connector.kv_verify import tokens_written
from kvpath.connector.layout import build_descs
from kvpath.connector.tp_map import plan, rank_kv


class PushDescs:
    """P's side of the planning: its layout and compatibility, and whether a D's blocks
    have P's sizes (``same_sizes``: the lane setup's answer for D's Hello)."""

    def __init__(self, layout: M.BlockLayout, compat: M.Compat, same_sizes: Callable[[M.Hello], bool]):
        self.layout, self.compat, self._same_sizes = layout, compat, same_sizes

    def whole(self, hello: M.Hello, p_blocks: list[int], reg: M.Register) -> tuple[np.ndarray, np.ndarray, int]:
        """The WRITE's descriptors: blocks as they are at equal sizes; else the heads this
        rank holds that D's rank needs, each at its offset in D's blocks (tp_map.plan)."""
        return self._plan(self.layout, hello.layout, hello, p_blocks, reg)

    def layers(self, hello: M.Hello, p_blocks: list[int], reg: M.Register, first: int, last: int,
               n_layers: int, tokens: tuple[int, int | None] = (0, None)) -> tuple[np.ndarray, np.ndarray, int]:
        """The descriptors of layers ``[first, last)`` of ``n_layers`` (of the tokens
        ``tokens``, as :meth:`whole` takes them)."""
        if not 0 <= first <= last <= n_layers:
            raise ValueError(f"layers [{first}, {last}) outside the model's {n_layers}")
        return self._plan(_layer_slice(self.layout, first, last, n_layers),
                          _layer_slice(hello.layout, first, last, n_layers), hello, p_blocks, reg, tokens)

    def tokens(self, hello: M.Hello, p_blocks: list[int], reg: M.Register, start: int,
               end: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """The descriptors of the prompt's tokens ``[start, end)`` (None: to the end), every
        layer. ``start`` and a given ``end`` fall on P's block boundaries; at equal block
        sizes the ranges of a push add up to its whole descriptors, at unequal ones to
        its whole bytes (a D block cut by a boundary is written in two)."""
        return self._plan(self.layout, hello.layout, hello, p_blocks, reg, (start, end))

    def _plan(self, local: M.BlockLayout, remote: M.BlockLayout, hello: M.Hello, p_blocks: list[int],
              reg: M.Register, tokens: tuple[int, int | None] = (0, None)) -> tuple[np.ndarray, np.ndarray, int]:
        start, end = tokens
        p_bs, d_bs = self.layout.block_size, hello.layout.block_size
        if start % p_bs or (end is not None and end % p_bs) or start < 0 or (end is not None and end < start):
            raise ValueError(f"tokens [{start}, {end}) must fall on P's {p_bs}-token block boundaries")
        skip = reg.skip_blocks
        if self._same_sizes(hello):
            first = max(start // p_bs, skip)
            last = skip + len(reg.block_ids) if end is None else min(end // p_bs, skip + len(reg.block_ids))
            if last <= first:
                return build_descs(local, remote, [], [])
            return build_descs(local, remote, p_blocks[first:last], reg.block_ids[first - skip : last - skip])
        # The tokens both sides' blocks hold: past the prompt's last token they are the
        # last blocks' unused rows (decode's, on D), never another request's block.
        n = tokens_written(p_bs, len(p_blocks), d_bs, skip + len(reg.block_ids))
        first, last = max(start, skip * d_bs), n if end is None else min(end, n)
        # D's skipped blocks (its prefix hits) are not written: placeholders, never read
        return plan(rank_kv(local, self.compat), rank_kv(remote, hello.compat), None, p_blocks,
                    [0] * skip + list(reg.block_ids), max(last, first), first)

    def too_few_blocks(self, hello: M.Hello, p_blocks: list[int], reg: M.Register) -> str:
        """Why P's blocks cannot fill D's (another prompt length), or "": at equal block
        sizes P has a block for each of D's; else P's tokens reach into D's last block."""
        d_blocks = reg.skip_blocks + len(reg.block_ids)
        p_bs, d_bs = self.layout.block_size, hello.layout.block_size
        if p_bs == d_bs:
            ok = len(p_blocks) >= d_blocks
        else:
            ok = len(p_blocks) * p_bs > (d_blocks - 1) * d_bs
        return "" if ok else (f"P has {len(p_blocks)} blocks of {p_bs} tokens, D expects {d_blocks} blocks of "
                              f"{d_bs} tokens")


def _layer_slice(layout: M.BlockLayout, first: int, last: int, n_layers: int) -> M.BlockLayout:
    per, extra = divmod(len(layout.regions), n_layers)
    if extra or per == 0:
        raise ValueError(f"{len(layout.regions)} regions are not {n_layers} layers of equal region counts")
    return msgspec.structs.replace(layout, regions=layout.regions[first * per : last * per])
