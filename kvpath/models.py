"""Model shapes and accelerators: what the iteration-time model and the KV sizes need.

Shapes are the models' published configs (Hugging Face ``config.json``); accelerator
numbers are the vendors' dense BF16 peak and memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass


class ModelSpecError(ValueError):
    pass


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: float  # parameter count
    dtype_bytes: int = 2


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_tflops: float  # dense BF16
    mem_bw_gbs: float  # GB/s
    mem_gib: float


MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.6e9),
    # Qwen/Qwen2.5-7B config.json
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7.62e9),
}

ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("h100", 989.0, 3350.0, 80),  # H100 SXM
    "a100": Accelerator("a100", 312.0, 2039.0, 80),  # A100 80GB SXM
    "l40s": Accelerator("l40s", 362.0, 864.0, 48),
}


def model_preset(name: str) -> ModelShape:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ModelSpecError(f"model {name!r} unknown; known: {', '.join(MODELS)}") from None


def accelerator_preset(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        raise ModelSpecError(f"accelerator {name!r} unknown; known: {', '.join(ACCELERATORS)}") from None


def kv_bytes_per_token(m: ModelShape) -> int:
    """K and V of every layer: 2 x layers x kv_heads x head_dim x dtype bytes
    (LLaMA-3-8B in BF16: 131,072 B)."""
    return 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes
