"""What an engine tells its peers in the handshake about itself (read from vLLM's
config), and the configurations kvpath refuses at start-up, naming the setting."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Iterable

from kvpath.connector.config import ConfigError, KVPathConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def refuse_unsupported(vllm_config: "VllmConfig") -> None:
    """Configurations whose KV kvpath cannot move correctly: refused before serving."""
    pc, cc = vllm_config.parallel_config, vllm_config.cache_config
    cache_dtype = str(cc.cache_dtype or "auto")
    if cache_dtype.startswith("fp8"):
        raise ConfigError(f"kv_cache_dtype {cache_dtype!r}: KVPathConnector does not carry fp8 KV scales "
                          "(k_scale/v_scale), so D would decode with the wrong ones; serve with kv_cache_dtype auto")
    for name in ("data_parallel_size", "pipeline_parallel_size"):
        n = getattr(pc, name, 1) or 1
        if n > 1:
            # every worker of a DP or PP group would bind the same side-channel port
            # (side_channel_port + TP rank), and D pairs ranks by TP rank only
            raise ConfigError(f"{name} is {n}: KVPathConnector supports tensor parallelism only "
                              f"(run one engine per data-parallel rank, each with its own side_channel_port)")


def compat_fields(vllm_config: "VllmConfig", cfg: KVPathConfig) -> dict[str, Any]:
    """What the handshake compares besides the layout and the layers: the served model
    and its identity (path and revision, or the model_identity knob), quantization,
    KV dtype, vLLM's version, TP size and the model's KV head count."""
    import vllm

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    names = mc.served_model_name
    model = names[0] if isinstance(names, (list, tuple)) and names else str(names or mc.model)
    dtype = str(mc.dtype) if cc.cache_dtype in (None, "auto") else str(cc.cache_dtype)
    # the last part of the path or repo id: one model under two directories matches,
    # two fine-tunes in sibling directories do not
    name = str(mc.model).rstrip("/").rpartition("/")[2] or str(mc.model)
    identity = cfg.model_identity or f"{name}@{getattr(mc, 'revision', None) or 'default'}"
    return {"model": model, "model_identity": identity, "quantization": str(getattr(mc, "quantization", None) or ""),
            "vllm_version": str(vllm.__version__), "dtype": dtype.removeprefix("torch."),
            "tp_size": vllm_config.parallel_config.tensor_parallel_size, "kv_heads": mc.get_total_num_kv_heads()}


def attention_backend(vllm_config: "VllmConfig") -> str:
    """The attention backends of the model's layers (their KV layout in memory), once
    the model is loaded; "" when vLLM cannot tell (then both sides send "")."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))
    except Exception:  # an internal API: its absence must not stop the engine
        logger.warning("kvpath: the attention backend could not be read; not compared", exc_info=True)
        return ""


def layers_digest(layer_names: Iterable[str]) -> str:
    """The KV layers, names and order: ``count:digest``."""
    names = list(layer_names)
    return f"{len(names)}:{hashlib.sha256(chr(10).join(names).encode()).hexdigest()[:12]}"
