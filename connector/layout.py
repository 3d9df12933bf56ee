"""KV memory layout and descriptor coalescing.

A layout is a list of regions, each holding ``num_blocks`` blocks at a fixed
stride (for vLLM: one region per layer and per K/V half). A push of P blocks
``src`` into D blocks ``dst`` becomes one descriptor per region per *run*, a run
being a stretch where both ``src`` and ``dst`` ids are consecutive. Sorted free
lists keep runs long (see PegaFlow's 118 vs 18,880 descriptors).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from kvpath.connector.messages import BlockLayout, Region


class LayoutMismatch(ValueError):
    pass


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block lists into (src_start, dst_start, length) runs."""
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} blocks, dst has {len(dst)}")
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:]):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out


def check_compatible(local: BlockLayout, remote: BlockLayout) -> None:
    """Raise LayoutMismatch when P's blocks cannot be written into D's as they are."""
    if local.block_size != remote.block_size:
        raise LayoutMismatch(
            f"block_size differs (P {local.block_size}, D {remote.block_size}); "
            "heterogeneous block sizes are not supported"
        )
    if len(local.regions) != len(remote.regions):
        raise LayoutMismatch(
            f"region count differs (P {len(local.regions)}, D {len(remote.regions)}): "
            "different model, layer count or TP layout"
        )
    for i, (a, b) in enumerate(zip(local.regions, remote.regions)):
        if a.block_len != b.block_len:
            raise LayoutMismatch(f"region {i}: block_len P {a.block_len} != D {b.block_len}")


def build_descs(
    local: BlockLayout,
    remote: BlockLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    coalesce: bool = True,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (local Nx3, remote Nx3, bytes) descriptor arrays for NIXL."""
    rs = runs(src_blocks, dst_blocks) if coalesce else [(s, d, 1) for s, d in zip(src_blocks, dst_blocks)]
    loc_rows: list[tuple[int, int, int]] = []
    rem_rows: list[tuple[int, int, int]] = []
    total = 0
    for lr, rr in zip(local.regions, remote.regions):
        dense = lr.block_len == lr.block_stride and rr.block_len == rr.block_stride
        for s, d, n in rs:
            if dense:
                length = n * lr.block_len
                loc_rows.append((lr.base + s * lr.block_stride, length, local.device_id))
                rem_rows.append((rr.base + d * rr.block_stride, length, remote.device_id))
                total += length
            else:  # interleaved blocks: one descriptor per block
                for k in range(n):
                    loc_rows.append((lr.base + (s + k) * lr.block_stride, lr.block_len, local.device_id))
                    rem_rows.append((rr.base + (d + k) * rr.block_stride, rr.block_len, remote.device_id))
                    total += lr.block_len
    loc = np.array(loc_rows, dtype=np.uint64).reshape(-1, 3)
    rem = np.array(rem_rows, dtype=np.uint64).reshape(-1, 3)
    return loc, rem, total


def layout_from_buffers(
    buffers: Iterable[tuple[int, int]], num_blocks: int, block_size: int, mem_type: str = "DRAM", device_id: int = 0
) -> BlockLayout:
    """Layout of plain dense buffers (addr, nbytes), each holding num_blocks blocks."""
    regions = []
    for addr, nbytes in buffers:
        if nbytes % num_blocks:
            raise ValueError(f"buffer of {nbytes} bytes is not a multiple of {num_blocks} blocks")
        blen = nbytes // num_blocks
        regions.append(Region(addr, blen, blen))
    return BlockLayout(regions=regions, num_blocks=num_blocks, block_size=block_size, mem_type=mem_type, device_id=device_id)


def layout_from_tensors(tensors: Sequence[Any], num_blocks: int, block_size: int) -> tuple[BlockLayout, list[tuple[int, int]]]:
    """Layout of vLLM per-layer KV tensors (torch), in the given order.

    The block dimension is the first whose size is ``num_blocks``; the dimensions
    before it (e.g. K/V) split the tensor into regions; the ones after it must be
    one contiguous block. Returns the layout and the memory spans to register.
    """
    regions: list[Region] = []
    spans: list[tuple[int, int]] = []
    mem_type, device_id = "DRAM", 0
    for t in tensors:
        if t.device.type != "cpu":
            mem_type, device_id = "VRAM", t.device.index or 0
        shape, strides, esz = list(t.shape), list(t.stride()), t.element_size()
        try:
            bdim = shape.index(num_blocks)
        except ValueError:
            raise LayoutMismatch(f"KV tensor of shape {tuple(shape)} has no dimension of {num_blocks} blocks") from None
        inner = 1
        expect = 1
        for dim in range(len(shape) - 1, bdim, -1):
            if shape[dim] > 1 and strides[dim] != expect:
                raise LayoutMismatch(f"KV tensor of shape {tuple(shape)} is not block-contiguous")
            expect *= shape[dim]
            inner *= shape[dim]
        block_len = inner * esz
        block_stride = strides[bdim] * esz
        outer = shape[:bdim]
        idxs = np.ndindex(*outer) if outer else [()]
        for idx in idxs:
            off = sum(i * strides[d] for d, i in enumerate(idx)) * esz
            regions.append(Region(t.data_ptr() + off, block_stride, block_len))
        spans.append((t.data_ptr(), t.untyped_storage().nbytes() if hasattr(t, "untyped_storage") else t.numel() * esz))
    return (
        BlockLayout(regions=regions, num_blocks=num_blocks, block_size=block_size, mem_type=mem_type, device_id=device_id),
        merge_spans(spans),
    )


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping/adjacent (addr, len) spans so each byte registers once."""
    out: list[list[int]] = []
    for a, n in sorted(spans):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]
