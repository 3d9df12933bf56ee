"""Start-up refusals and the handshake's record, read from a vLLM config."""

from types import SimpleNamespace

import pytest

from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.messages import Compat
from kvpath.connector.vllm_compat import compat_fields, layers_digest, refuse_unsupported


def vllm_config(cache_dtype="auto", dp=1, pp=1, model="/models/tiny", revision=None, quantization=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        model_config=SimpleNamespace(served_model_name=["tiny"], model=model, revision=revision, dtype="torch.float32",
                                     quantization=quantization, get_total_num_kv_heads=lambda: 4),
    )


@pytest.mark.parametrize("kw, named", [({"cache_dtype": "fp8"}, "kv_cache_dtype"),
                                       ({"cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"),
                                       ({"dp": 2}, "data_parallel_size"),
                                       ({"pp": 2}, "pipeline_parallel_size")])
def test_what_kvpath_cannot_move_is_refused_at_start_naming_the_setting(kw, named):
    with pytest.raises(ConfigError, match=named):
        refuse_unsupported(vllm_config(**kw))


def test_a_supported_config_passes():
    refuse_unsupported(vllm_config())


def test_two_fine_tunes_served_under_one_name_differ_in_model_identity():
    cfg = KVPathConfig(control_plaintext=True)
    a = Compat(**compat_fields(vllm_config(model="/models/ft-a"), cfg))
    b = Compat(**compat_fields(vllm_config(model="/models/ft-b"), cfg))
    assert a.model == b.model == "tiny"
    assert a.mismatch(b)[0] == "model_identity"
    # the knob: one model at two paths
    same = KVPathConfig(control_plaintext=True, model_identity="tiny-v1")
    assert Compat(**compat_fields(vllm_config(model="/a"), same)).mismatch(
        Compat(**compat_fields(vllm_config(model="/b"), same))) is None
    q = Compat(**compat_fields(vllm_config(model="/models/ft-a", quantization="awq"), cfg))
    assert a.mismatch(q)[0] == "quantization"


def test_layer_names_and_order_are_compared():
    assert layers_digest(["l0", "l1"]) != layers_digest(["l1", "l0"])
    assert layers_digest(["l0", "l1"]).startswith("2:")
    a, b = Compat(layers=layers_digest(["l0", "l1"])), Compat(layers=layers_digest(["l0", "l2"]))
    assert a.mismatch(b)[0] == "layers"


def test_the_record_carries_the_models_kv_head_count():
    cfg = KVPathConfig(control_plaintext=True)
    assert Compat(**compat_fields(vllm_config(), cfg)).kv_heads == 4

