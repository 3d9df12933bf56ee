"""The tiny model: deterministic per spec, cached per spec, parametric in its shape, and
(trained) readable words that depend on the prompt. Run with transformers, not vLLM."""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kvpath.tiny_model import MARKER, TinyModelSpec, build_tiny_model, write_tiny_model
from kvpath.tiny_model.training import TRAINED_STEPS, corpus_prompts, corpus_words

# small enough to train a few steps in about a second
SMALL = TinyModelSpec(layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=400, steps=3)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy(model_dir: Path, prompts: list[str], n: int = 16) -> list[str]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    for p in prompts:
        x = tok(p, return_tensors="pt")["input_ids"]
        y = model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(y[0, x.shape[1]:]))
    return out


@pytest.mark.parametrize("steps", [0, 3], ids=["random", "trained"])
def test_the_same_spec_gives_the_same_files_and_another_seed_other_weights(tmp_path, steps):
    spec = replace(SMALL, steps=steps)
    a, b = write_tiny_model(tmp_path / "a", spec), write_tiny_model(tmp_path / "b", spec)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha(a / f) == sha(b / f), f
    c = write_tiny_model(tmp_path / "c", replace(spec, seed=1))
    assert sha(c / "model.safetensors") != sha(a / "model.safetensors")
    if steps:  # training changes the weights
        d = write_tiny_model(tmp_path / "d", replace(spec, steps=steps + 1))
        assert sha(d / "model.safetensors") != sha(a / "model.safetensors")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_one_and_two_kv_heads_build_and_train(tmp_path, kv_heads):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    spec = replace(SMALL, layers=2, kv_heads=kv_heads, steps=2)
    out = write_tiny_model(tmp_path / "m", spec)
    cfg = AutoConfig.from_pretrained(str(out))
    shape = (cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers)
    assert shape == (kv_heads, 2, 32, 2)
    w = load_file(str(out / "model.safetensors"))
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == torch.Size([kv_heads * 32, 64])


def test_the_cache_builds_once_per_spec_even_for_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPATH_CACHE", str(tmp_path / "cache"))
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(build_tiny_model(None, SMALL))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    root = tmp_path / "cache" / "models"
    assert len(got) == 2 and got[0] == got[1] and got[0].parent == root
    assert [p.name for p in root.iterdir() if p.is_dir()] == [got[0].name]  # no temporary folder left
    mtime = (got[0] / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(None, SMALL) == got[0]
    assert (got[0] / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    # with a folder: a copy of the cached build; another spec: another folder
    out = build_tiny_model(tmp_path / "copy", SMALL)
    assert sha(out / "model.safetensors") == sha(got[0] / "model.safetensors") and (out / MARKER).exists()
    assert build_tiny_model(None, replace(SMALL, seed=5)) != got[0]


def test_the_demo_model_continues_each_prompt_with_corpus_words():
    """The trained model the demo serves (cached: trained once per machine, ~20 s)."""
    model = build_tiny_model(None, TinyModelSpec(steps=TRAINED_STEPS))
    prompts = corpus_prompts(4) + ["The old man walked down to the"]
    outs = greedy(model, prompts)
    assert len(set(outs)) == len(outs), outs  # the output depends on the prompt
    vocab = corpus_words()
    for o in outs:
        words = re.findall(r"[a-z]+", o.lower())
        assert len(words) >= 5, o
        assert sum(w in vocab for w in words) >= 0.8 * len(words), o


def test_random_weights_still_depend_on_the_prompt(tmp_path):
    """What the vLLM end-to-end tests serve: P/D == decode-only means something only if so."""
    from kvpath.testbed.pd_client import make_prompts

    outs = greedy(write_tiny_model(tmp_path / "m", TinyModelSpec()), make_prompts(3, seed=1), n=8)
    assert len(set(outs)) == 3, outs
