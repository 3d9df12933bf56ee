"""Build a tiny Llama and a locally trained tokenizer (no downloads).

Random weights (``steps=0``, what the tests and the testbed use) or, with ``steps > 0``,
weights trained for that many steps on the text the package ships
(:mod:`kvpath.tiny_model.training`), so greedy output is readable words continuing the prompt.
Trained models are built once per spec in a cache (``$KVPATH_CACHE/models``, default
``~/.cache/kvpath/models``). vLLM's CPU attention needs head_dim in {32, 64, 80, ...};
the defaults give a model that loads in seconds and serves with one core.
``kvpath model tiny`` is here too.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import random
import shutil
import sys
import tempfile
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
    steps: int = 0  # training steps on the shipped corpus; 0: random weights

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
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype}")


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def build_tokenizer(out: Path, spec: TinyModelSpec):
    """Byte-level BPE trained on the shipped corpus (trained models) or on random
    networking words (random weights)."""
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
    if spec.steps:
        from kvpath.tiny_model.training import corpus_text

        texts = corpus_text().splitlines()
    else:
        texts = _corpus(spec.seed)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def write_tiny_model(out: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build model + tokenizer into ``out`` (no cache) and return it. Deterministic: the
    same spec gives the same files (on one machine and one torch build)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    spec.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)  # written last: a folder with it is complete
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
    if spec.steps:
        from kvpath.tiny_model.training import train

        losses = train(model, tok, spec.steps, spec.seed)
        logger.info("tiny model trained for %d steps: loss %.2f -> %.2f", spec.steps, losses[0], losses[-1])
    else:
        # Larger-than-default init makes greedy outputs vary with the prompt.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.1)
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(out), safe_serialization=True)
    (out / MARKER).write_text(json.dumps(asdict(spec)))
    logger.info("tiny model written to %s", out)
    return out


MARKER = "kvpath_tiny_model.json"  # the spec a folder was built with


def cache_root() -> Path:
    return Path(os.environ.get("KVPATH_CACHE") or Path.home() / ".cache" / "kvpath") / "models"


def cached_tiny_model(spec: TinyModelSpec | None = None) -> Path:
    """The model's folder in the cache, built on first use. Keyed by a hash of the spec,
    the training settings and code version, the corpus and the library versions; built in
    a temporary folder and renamed into place, under a lock, so concurrent callers wait
    for one build and a crash never leaves a partial model."""
    from kvpath.tiny_model.training import training_key

    spec = spec or TinyModelSpec()
    spec.validate()
    root = cache_root()
    final = root / f"tiny-{training_key(asdict(spec))[:16]}"
    if (final / MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / MARKER).exists():
            return final
        for stale in root.glob(f".{final.name}-*"):  # a killed build's; only the lock holder builds this key
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            tmp.chmod(0o755)
            write_tiny_model(tmp, spec)
            shutil.rmtree(final, ignore_errors=True)  # a folder without a marker: not ours to keep
            os.rename(tmp, final)
            logger.info("tiny model cached in %s", final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def build_tiny_model(out: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Model + tokenizer for ``spec``; returns its folder. Without ``out``: the cached
    copy (:func:`cached_tiny_model`). With ``out``: written there, idempotent per spec;
    a trained model is copied from the cache, so it is trained once per machine."""
    spec = spec or TinyModelSpec()
    spec.validate()
    if out is None:
        return cached_tiny_model(spec)
    out = Path(out)
    marker = out / MARKER
    if _marked_spec(marker) == asdict(spec):
        return out
    marker.unlink(missing_ok=True)  # from here until the copy ends, the folder is not complete
    if not spec.steps:
        return write_tiny_model(out, spec)
    src = cached_tiny_model(spec)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name != MARKER:
            shutil.copy2(f, out / f.name)
    shutil.copy2(src / MARKER, marker)  # last: a folder with the marker is complete
    return out


def _marked_spec(marker: Path) -> dict | None:
    """The spec a folder's marker names; None when there is none or it cannot be read
    (a truncated marker means rebuild, not an error)."""
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions, seed=args.seed,
        dtype=args.dtype, steps=args.steps,
    )
    try:
        spec.validate()
    except ValueError as e:
        raise SystemExit(f"kvpath model tiny: error: {e}") from None
    sys.stdout.write(f"{build_tiny_model(args.out, spec)}\n")  # the model's folder: the command's output
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvpath model tiny``."""
    from kvpath.tiny_model.training import TRAINED_STEPS

    d = TinyModelSpec()
    model = sub.add_parser("model", help="local models for tests and demos").add_subparsers(dest="model_cmd")
    t = model.add_parser("tiny", help="write a tiny Llama (random or briefly trained weights) and a locally "
                                      "trained tokenizer; prints its folder")
    t.add_argument("--out", help="output directory (default: the model's folder in the cache, "
                                 "$KVPATH_CACHE/models or ~/.cache/kvpath/models)")
    t.add_argument("--steps", type=int, default=d.steps,
                   help=f"training steps on the text kvpath ships; 0: random weights (the demo uses {TRAINED_STEPS}, "
                        "about 20 s on one core); a trained model is built once per spec in the cache")
    t.add_argument("--layers", type=int, default=d.layers, help="decoder layers")
    t.add_argument("--heads", type=int, default=d.heads, help="attention (query) heads; hidden size = heads x head-dim")
    t.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads (divides --heads)")
    t.add_argument("--head-dim", type=int, default=d.head_dim, help="vLLM CPU attention needs 32, 64, 80, ... (not 16)")
    t.add_argument("--intermediate", type=int, default=d.intermediate, help="MLP intermediate size")
    t.add_argument("--vocab", type=int, default=d.vocab,
                   help="tokenizer vocabulary size (>= 300; the trained tokenizer may end up smaller)")
    t.add_argument("--max-positions", type=int, default=d.max_positions, help="max_position_embeddings")
    t.add_argument("--dtype", default=d.dtype, help="float32, bfloat16 or float16 (training is in float32)")
    t.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the weights, the training batches and (random weights) the tokenizer's words")
    t.set_defaults(func=_cmd_model_tiny)
