import random

import numpy as np
import pytest

from kvpath.connector.layout import LayoutMismatch, build_descs, check_compatible, layout_from_buffers, layout_from_tensors, merge_spans, runs
from kvpath.connector.messages import BlockLayout, Region


def test_runs_coalesce_only_when_both_sides_are_consecutive():
    assert runs([1, 2, 3], [7, 8, 9]) == [(1, 7, 3)]
    assert runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert runs([5, 4], [1, 2]) == [(5, 1, 1), (4, 2, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError):
        runs([1], [1, 2])


def _layout(n_regions=3, nb=64, blen=256, base=1 << 20):
    return layout_from_buffers([(base + i * nb * blen * 2, nb * blen) for i in range(n_regions)], nb, 16)


def test_contiguous_blocks_give_one_descriptor_per_region():
    lay = _layout()
    loc, rem, nbytes = build_descs(lay, lay, list(range(10, 30)), list(range(0, 20)))
    assert len(loc) == len(rem) == 3
    assert nbytes == 20 * 256 * 3
    assert int(loc[0, 0]) == lay.regions[0].base + 10 * 256 and int(loc[0, 1]) == 20 * 256
    assert int(rem[0, 0]) == lay.regions[0].base


def test_fragmented_blocks_need_more_descriptors_and_uncoalesced_is_per_block():
    lay = _layout()
    rng = random.Random(1)
    src = rng.sample(range(64), 20)
    dst = rng.sample(range(64), 20)
    loc, _, nbytes = build_descs(lay, lay, src, dst)
    assert len(loc) == 3 * len(runs(src, dst)) > 3
    loc2, _, nbytes2 = build_descs(lay, lay, list(range(20)), list(range(20)), coalesce=False)
    assert len(loc2) == 60 and nbytes2 == nbytes


def test_interleaved_regions_are_never_merged_across_blocks():
    lay = BlockLayout([Region(4096, 512, 256)], 8, 16)
    loc, _, nbytes = build_descs(lay, lay, [0, 1, 2], [3, 4, 5])
    assert len(loc) == 3 and nbytes == 768


def test_mismatched_layouts_are_refused():
    a = _layout(3)
    with pytest.raises(LayoutMismatch, match="region count"):
        check_compatible(a, _layout(2))
    with pytest.raises(LayoutMismatch, match="block_len"):
        check_compatible(a, _layout(3, blen=128))
    b = BlockLayout(a.regions, a.num_blocks, 32)
    with pytest.raises(LayoutMismatch, match="block_size"):
        check_compatible(a, b)


def test_layout_from_vllm_like_tensors():
    torch = pytest.importorskip("torch")
    nb = 10
    # (2, num_blocks, heads, block, dim): K and V halves are separate regions.
    t = torch.zeros(2, nb, 2, 16, 8)
    lay, spans = layout_from_tensors([t, torch.zeros(2, nb, 2, 16, 8)], nb, 16)
    assert len(lay.regions) == 4
    r0, r1 = lay.regions[0], lay.regions[1]
    assert r0.block_len == r0.block_stride == 2 * 16 * 8 * 4
    assert r1.base - r0.base == nb * r0.block_len
    assert len(spans) in (1, 2)
    # (num_blocks, 2, ...) : one region per tensor.
    lay2, _ = layout_from_tensors([torch.zeros(nb, 2, 16, 8)], nb, 16)
    assert len(lay2.regions) == 1 and lay2.regions[0].block_len == 2 * 16 * 8 * 4
    with pytest.raises(LayoutMismatch):
        layout_from_tensors([torch.zeros(3, 4)], nb, 16)


def test_merge_spans_registers_each_byte_exactly_once():
    assert merge_spans([(100, 10), (0, 50), (50, 10), (105, 20)]) == [(0, 60), (100, 25)]
    assert merge_spans([(0, 100), (10, 5)]) == [(0, 100)]  # contained
    assert merge_spans([]) == []
    rng = random.Random(5)
    for _ in range(200):
        spans = [(rng.randrange(0, 500), rng.randrange(1, 40)) for _ in range(rng.randrange(1, 8))]
        merged = merge_spans(spans)
        covered = np.zeros(600, dtype=bool)
        for a, n in spans:
            covered[a : a + n] = True
        got = np.zeros(600, dtype=int)
        for a, n in merged:
            got[a : a + n] += 1
        assert (got == covered).all()  # same bytes, none twice
        assert all(a1 + n1 < a2 for (a1, n1), (a2, _) in zip(merged, merged[1:]))  # disjoint, not adjacent


def test_pick_distinct_covers_every_path_then_fills_with_duplicates():
    from kvpath.connector.lanes import pick_distinct

    paths = ["s0", "s0", "s1", "s0", "s2", "s3", "s1"]
    opened = []

    def open_(i):
        opened.append(i)
        return paths[i]

    assert pick_distinct(open_, len(paths), want=3, distinct=3) == [0, 2, 4]
    assert opened == [0, 1, 2, 3, 4]  # stops as soon as the paths are covered
    opened.clear()
    # more lanes than paths: every path once, then duplicates in the order they came
    assert pick_distinct(open_, 4, want=3, distinct=2) == [0, 2, 1]
    # a pool too small to cover them all still gives `want` lanes
    assert pick_distinct(lambda i: "s0", 5, want=3, distinct=3) == [0, 1, 2]
    # one path (same leaf): the first `want` candidates, no extra connections
    opened.clear()
    assert pick_distinct(open_, 7, want=2, distinct=1) == [0, 1] and opened == [0, 1]
