"""Training the tiny Llama on the text the package ships (``kvpath/tiny_model/data/corpus.txt``:
about 11 KB of simple English, fables retold and short descriptions written for kvpath),
so that its greedy output is readable words that continue the prompt.

A fixed number of steps, not a time budget, on one thread with deterministic
algorithms and seeded initialisation and batches: the same spec and seed give the same
weights on one machine and one torch build (other CPUs or builds may round
differently). ``TRAINED_STEPS`` (the demo's default) takes about 20 s on one core.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
# Part of every cached model's key: bump it when a change here changes the weights.
TRAINING_VERSION = 1
TRAINED_STEPS = 100  # the demo's model: readable continuations, about 20 s on one core


@dataclass(frozen=True)
class TrainSettings:
    lr: float = 2e-3  # AdamW, no weight decay, after a linear warm-up
    warmup: int = 10  # steps
    batch: int = 16  # windows per step
    seq_len: int = 64  # tokens per window
    clip: float = 1.0  # gradient norm


def corpus_text() -> str:
    return CORPUS.read_text(encoding="utf-8")


def corpus_words() -> set[str]:
    """The corpus' words, lower case (what a trained model's output should be made of)."""
    return set(re.findall(r"[a-z]+", corpus_text().lower()))


def corpus_prompts(n: int, seed: int = 0, min_words: int = 30, max_words: int = 60) -> list[str]:
    """``n`` distinct passages of the corpus, each starting at a sentence and ending mid-way,
    for a trained model to continue (30 words are more than one 32-token KV block)."""
    text = corpus_text()
    words = text.split()
    starts = [i for i, w in enumerate(words) if i == 0 or words[i - 1].endswith((".", "!", "?", '."'))]
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        i = rng.choice(starts)
        p = " ".join(words[i: i + rng.randint(min_words, max_words)])
        if p not in out or len(out) >= len(starts):
            out.append(p)
    return out


def training_key(spec: dict[str, Any], settings: TrainSettings = TrainSettings()) -> str:
    """What a cached model depends on: the spec, the training settings and code version,
    the corpus, and the versions of the libraries that compute and write the weights."""
    from importlib.metadata import version  # not importing them: a cache hit stays fast

    parts = {
        "spec": spec, "settings": asdict(settings), "training_version": TRAINING_VERSION,
        "corpus": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
        **{lib: version(lib) for lib in ("torch", "transformers", "tokenizers")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def train(model, tokenizer, steps: int, seed: int, settings: TrainSettings = TrainSettings()) -> list[float]:
    """Train ``model`` in place for ``steps`` steps on random windows of the corpus; returns
    the losses. One thread, deterministic algorithms; the previous settings are restored."""
    import torch

    ids = torch.tensor(tokenizer(corpus_text())["input_ids"], dtype=torch.long)
    if len(ids) <= settings.seq_len + 1:
        raise ValueError(f"the corpus ({len(ids)} tokens) is shorter than a training window ({settings.seq_len})")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        model.train()
        losses = []
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / settings.warmup)
            starts = torch.randint(0, len(ids) - settings.seq_len, (settings.batch,), generator=gen)
            x = torch.stack([ids[s: s + settings.seq_len] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
            opt.step()
            losses.append(loss.item())
        model.eval()
        return losses
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
