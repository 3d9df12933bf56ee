"""A push's descriptors in pieces (connector/push_descs.py): its layer ranges and its
token ranges each add up to the whole push, byte for byte in D's cache, at equal and
unequal TP and block sizes, with D's prefix hits skipped."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvpath.connector.messages import BlockLayout, Compat
from kvpath.connector.push_descs import PushDescs
from tests.connector.test_tp_map import LAYERS, SENTINEL, apply, cdiv, make_rank


def _side(tp: int, heads: int, bs: int, blocks: int, fill):
    r = make_rank(tp, 0, heads, bs, blocks, np.float32, fill)
    layout = BlockLayout(regions=list(r.kv.regions), num_blocks=blocks, block_size=bs)
    return r, layout, Compat(model="tiny", tp_size=tp, tp_rank=0, block_size=bs, kv_heads=heads)


@pytest.mark.parametrize("heads,p_tp,d_tp,p_bs,d_bs,skip", [
    (2, 1, 1, 32, 32, 0), (2, 1, 1, 32, 32, 1),  # equal: build_descs
    (2, 2, 1, 32, 32, 0), (2, 1, 2, 32, 32, 1), (2, 1, 1, 32, 64, 0), (2, 1, 1, 64, 32, 1)])  # tp_map.plan
def test_layer_and_token_ranges_add_up_to_the_whole_push(heads, p_tp, d_tp, p_bs, d_bs, skip):
    rng = np.random.default_rng(5)
    n = 200  # prompt tokens
    P, p_layout, p_compat = _side(p_tp, heads, p_bs, 2 * cdiv(n, p_bs) + 3, lambda s: rng.standard_normal(s))
    src = rng.permutation(p_layout.num_blocks)[: cdiv(n, p_bs)].tolist()
    d_blocks = cdiv(n, d_bs)
    dst = rng.permutation(2 * d_blocks + 3)[skip:d_blocks].tolist()  # D had its first `skip` blocks
    reg = SimpleNamespace(skip_blocks=skip, block_ids=dst)

    def run(pieces) -> tuple[list[np.ndarray], int]:
        D, d_layout, d_compat = _side(d_tp, heads, d_bs, 2 * d_blocks + 3, lambda s: np.full(s, SENTINEL))
        hello = SimpleNamespace(layout=d_layout, compat=d_compat)
        descs = PushDescs(p_layout, p_compat, lambda h: p_tp == d_tp and p_bs == d_bs)
        total = 0
        for piece in pieces:
            loc, rem, nbytes = piece(descs, hello)
            assert apply(loc, rem, P, D) == nbytes
            total += nbytes
        return [a.copy() for a in D.arrays], total

    whole, whole_bytes = run([lambda d, h: d.whole(h, src, reg)])
    assert whole_bytes > 0
    by_layer = run([lambda d, h, k=k: d.layers(h, src, reg, k, k + 1, LAYERS) for k in range(LAYERS)])
    cuts = [0, 2 * p_bs, 3 * p_bs, None]
    by_tokens = run([lambda d, h, a=a, b=b: d.tokens(h, src, reg, a, b) for a, b in zip(cuts, cuts[1:])])
    for got, nbytes in (by_layer, by_tokens):
        assert nbytes == whole_bytes
        assert all(np.array_equal(g, w) for g, w in zip(got, whole))


def test_a_token_range_off_p_s_block_boundaries_is_refused():
    P, layout, compat = _side(1, 2, 32, 8, np.zeros)
    descs = PushDescs(layout, compat, lambda h: True)
    hello = SimpleNamespace(layout=layout, compat=compat)
    with pytest.raises(ValueError, match="block boundaries"):
        descs.tokens(hello, [1, 2], SimpleNamespace(skip_blocks=0, block_ids=[3, 4]), 10, None)
