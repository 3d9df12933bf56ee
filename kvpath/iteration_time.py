"""The iteration-time model: how long one continuous-batching iteration takes.

A roofline with three constants: an iteration takes ``max(compute, memory) +
overhead``, where compute is its FLOPs at ``mfu`` of the accelerator's peak and memory
is the bytes it reads (weights once, plus the KV of every sequence's context) at
``mbu`` of its bandwidth. FLOPs: ``2 x params`` per token, plus attention: ``4 x
layers x q_dim`` per (token, context position) pair, causal prefill counting half the
square. The emulated engines and the simulator use this one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpath.models import (  # noqa: F401  (ModelSpecError: raised here, imported from here too)
    Accelerator, ModelShape, ModelSpecError, accelerator_preset, kv_bytes_per_token, model_preset)


@dataclass(frozen=True)
class IterationTimeModel:
    model: ModelShape
    accel: Accelerator
    mfu: float = 0.7  # share of peak FLOPs reached
    mbu: float = 0.8  # share of memory bandwidth reached
    overhead_s: float = 0.002  # scheduler, launch and sampling per iteration

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ModelSpecError(f"iteration_time.{name} must be in (0, 1], got {v!r}")
        if not isinstance(self.overhead_s, (int, float)) or self.overhead_s < 0:
            raise ModelSpecError(f"iteration_time.overhead_s must be >= 0, got {self.overhead_s!r}")

    @classmethod
    def preset(cls, model: str = "llama-3-8b", accelerator: str = "h100", **kw: float) -> "IterationTimeModel":
        return cls(model_preset(model), accelerator_preset(accelerator), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "IterationTimeModel":
        d = dict(d)
        known = {"model", "accelerator", "mfu", "mbu", "overhead_s"}
        bad = sorted(set(d) - known)
        if bad:
            raise ModelSpecError(f"iteration_time: unknown field(s) {bad}; known: {sorted(known)}")
        return cls.preset(d.pop("model", "llama-3-8b"), d.pop("accelerator", "h100"), **d)

    def to_dict(self) -> dict:
        return {"model": self.model.name, "accelerator": self.accel.name, "mfu": self.mfu, "mbu": self.mbu,
                "overhead_s": self.overhead_s}

    # -- the roofline -------------------------------------------------------------------
    def _time(self, flops: float, bytes_read: float) -> float:
        compute = flops / (self.accel.peak_tflops * 1e12 * self.mfu)
        memory = bytes_read / (self.accel.mem_bw_gbs * 1e9 * self.mbu)
        return max(compute, memory) + self.overhead_s

    def iteration_time(self, prefill_tokens: list[int] | np.ndarray, decode_contexts: list[int] | np.ndarray) -> float:
        """One iteration with whole prompts of ``prefill_tokens`` (each from position 0)
        and one new token for each decode sequence of context ``decode_contexts``."""
        p = np.asarray(prefill_tokens, dtype=float)
        c = np.asarray(decode_contexts, dtype=float)
        return self._sums(float(p.sum()), float((p * p).sum()), c.size, float(c.sum()))

    def _sums(self, p_sum: float, p_sq: float, n_decode: int, c_sum: float) -> float:
        """The roofline of an iteration from its sums: prompt tokens, their squares, decode
        sequences and their contexts (every form of the model goes through here)."""
        m = self.model
        tokens = p_sum + n_decode
        if not tokens:
            return 0.0
        flops = 2 * m.params * tokens + 4 * m.layers * m.heads * m.head_dim * (0.5 * p_sq + c_sum)
        bytes_read = m.params * m.dtype_bytes + kv_bytes_per_token(m) * (p_sum + c_sum)
        return self._time(flops, bytes_read)

    def one_prefill_time(self, tokens: int) -> float:
        """``prefill_time([tokens])`` without numpy (a placement costs many)."""
        return self._sums(float(tokens), float(tokens) * tokens, 0, 0.0)

    def uniform_decode_time(self, n: int, context: int) -> float:
        """``decode_time([context] * n)`` without numpy."""
        return self._sums(0.0, 0.0, n, float(n) * context)

    def prefill_time(self, tokens: list[int] | np.ndarray) -> float:
        return self.iteration_time(tokens, [])

    def decode_time(self, contexts: list[int] | np.ndarray) -> float:
        return self.iteration_time([], contexts)

