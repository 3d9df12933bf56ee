import subprocess
import sys

import pytest

from kvpath import __version__
from kvpath.cli import main


def test_version():
    out = subprocess.run([sys.executable, "-m", "kvpath.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"kvpath {__version__}"


@pytest.mark.parametrize(
    "args, field",
    [(["--head-dim", "16"], "--head-dim"), (["--heads", "3", "--kv-heads", "2"], "--heads"), (["--vocab", "10"], "--vocab"),
     (["--steps", "-1"], "--steps")],
)
def test_model_tiny_bad_arguments_name_the_field(tmp_path, capsys, args, field):
    with pytest.raises(SystemExit) as e:
        main(["model", "tiny", "--out", str(tmp_path / "m"), *args])
    assert field in str(e.value)


def test_model_tiny_builds_a_loadable_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "m"
    assert main(["model", "tiny", "--out", str(out), "--layers", "1", "--head-dim", "32"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok("the spine leaf lane")["input_ids"]
    assert ids and tok.decode(ids) == "the spine leaf lane"
    cfg = transformers.AutoConfig.from_pretrained(str(out))
    assert cfg.head_dim == 32 and cfg.num_hidden_layers == 1 and cfg.vocab_size == len(tok)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    # a second build with the same spec is a no-op
    mtime = (out / "model.safetensors").stat().st_mtime
    main(["model", "tiny", "--out", str(out), "--layers", "1", "--head-dim", "32"])
    assert (out / "model.safetensors").stat().st_mtime == mtime


@pytest.mark.e2e
def test_connector_demo_the_readme_runs_ends_with_every_request_pushed(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpath.cli", "connector", "demo", "--workdir", str(tmp_path),
                          "--base-port", "8700"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "8/8 requests ok, 8 pushes" in out.stdout
    assert "lanes to " in out.stdout and "->" in out.stdout
