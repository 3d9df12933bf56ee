"""The iteration-time model and model shapes."""

from __future__ import annotations

import pytest

from kvpath.iteration_time import IterationTimeModel
from kvpath.models import ModelSpecError, kv_bytes_per_token, model_preset


def test_kv_bytes_per_token_of_llama3_8b():
    assert kv_bytes_per_token(model_preset("llama-3-8b")) == 2 * 32 * 8 * 128 * 2 == 131072


def test_prefill_is_compute_bound_and_decode_memory_bound_on_h100():
    m = IterationTimeModel.preset("llama-3-8b", "h100")
    # 1024 tokens: 2 x 8.03e9 x 1024 + attention ~ 1.7e13 FLOP at 0.7 x 989 TFLOP/s = ~24 ms, + 2 ms
    assert 0.020 < m.prefill_time([1024]) < 0.032
    assert m.prefill_time([4096]) > 3.5 * m.prefill_time([1024]) - 0.01
    # one decode token reads the 16 GB of weights: ~6 ms at 0.8 x 3.35 TB/s, + 2 ms
    assert 0.007 < m.decode_time([2048]) < 0.010
    assert m.decode_time([2048] * 32) < 2 * m.decode_time([2048])  # batching is nearly free when memory bound


def test_bad_specs_name_the_field():
    with pytest.raises(ModelSpecError, match="mfu"):
        IterationTimeModel.preset(mfu=1.5)
    with pytest.raises(ModelSpecError, match="unknown field"):
        IterationTimeModel.from_dict({"model": "llama-3-8b", "flops": 1})
    with pytest.raises(ModelSpecError, match="llama-9"):
        IterationTimeModel.preset("llama-9")
