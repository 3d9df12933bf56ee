"""Build a tiny random-weight Llama and a locally trained tokenizer (no downloads).

vLLM's CPU attention needs head_dim in {32, 64, 80, ...}; the defaults give a
model that loads in seconds and serves with one core. ``kvpath model tiny`` is here too.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the a network spine leaf packet flow lane path prefill decode cache block token "
    "model layer head transfer push pull engine proxy request reply fabric switch link "
    "queue rate byte time fast slow small large red green blue one two three four five "
    "data center server client port route hash seed we you they run send read write"
).split()


@dataclass
class TinyModelSpec:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0
    dtype: str = "float32"

    def validate(self) -> None:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"--head-dim must be one of {SUPPORTED_HEAD_DIMS} (vLLM CPU attention), got {self.head_dim}")
        for name in ("layers", "heads", "kv_heads", "intermediate", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
        if self.vocab < 300:
            raise ValueError("--vocab must be >= 300 (byte-level alphabet plus merges)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype}")


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def build_tokenizer(out: Path, spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_tiny_model(out: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write model + tokenizer into ``out`` and return it. Idempotent per spec."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    spec.validate()
    out = Path(out)
    marker = out / "kvpath_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, spec)
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.heads * spec.head_dim,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init makes greedy outputs vary with the prompt.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(asdict(spec)))
    logger.info("tiny model written to %s", out)
    return out


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions, seed=args.seed,
        dtype=args.dtype,
    )
    try:
        spec.validate()
    except ValueError as e:
        raise SystemExit(f"kvpath model tiny: error: {e}") from None
    sys.stdout.write(f"{build_tiny_model(args.out, spec)}\n")  # the model's folder: the command's output
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvpath model tiny``."""
    model = sub.add_parser("model", help="local models for tests and demos").add_subparsers(dest="model_cmd")
    t = model.add_parser("tiny", help="write a tiny random-weight Llama and a locally trained tokenizer")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64, help="vLLM CPU attention needs 32, 64, 80, ... (not 16)")
    t.add_argument("--intermediate", type=int, default=512)
    t.add_argument("--vocab", type=int, default=1024)
    t.add_argument("--max-positions", type=int, default=4096)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_cmd_model_tiny)
