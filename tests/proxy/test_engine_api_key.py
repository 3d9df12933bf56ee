"""The engines' API key (vLLM's --api-key): where the proxy reads it (a file or the
environment, never argv), and how every real P and D start passes it (the child's
environment, never its command line). No engine runs here; tests/proxy/test_proxy_access.py checks
the legs' headers against stub engines, tests/proxy/test_proxy_vllm_e2e.py against vLLM."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpath.proxy.cli import load_engine_api_key

KEY = "k3y-Zq9-for-the-engines"


def test_the_key_file_wins_then_kvpaths_variable_then_vllms(tmp_path):
    f = tmp_path / "engine-key"
    f.write_text(KEY + "\n")
    env = {"KVPATH_ENGINE_API_KEY": "from-kvpath-env", "VLLM_API_KEY": "from-vllm-env"}
    assert load_engine_api_key(str(f), environ=env) == KEY
    assert load_engine_api_key(None, environ=env) == "from-kvpath-env"
    assert load_engine_api_key(None, environ={"VLLM_API_KEY": "from-vllm-env"}) == "from-vllm-env"
    assert load_engine_api_key(None, environ={"KVPATH_ENGINE_API_KEY": " ", "VLLM_API_KEY": "v"}) == "v"
    assert load_engine_api_key(None, environ={}) is None


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("", "is empty"), ("a\nb\n", "more than one line"),
                                           ("x" * 5000, "over 4096 bytes")])
def test_a_bad_key_file_is_one_error_line_naming_the_option(tmp_path, content, says):
    f = tmp_path / "engine-key"
    if content is not None:
        f.write_text(content)
    with pytest.raises(SystemExit) as e:
        load_engine_api_key(str(f), environ={})
    msg = str(e.value)
    assert msg.startswith("kvpath proxy: error: --engine-api-key-file: ") and says in msg


def test_a_key_that_is_not_printable_ascii_is_refused_naming_where_it_came_from():
    with pytest.raises(SystemExit, match=r"\$VLLM_API_KEY: the engine API key must be one line of printable ASCII"):
        load_engine_api_key(None, environ={"VLLM_API_KEY": "caf\u00e9"})


def test_kvpath_proxy_takes_the_key_from_its_file_or_environment_into_its_config(tmp_path, monkeypatch):
    import uvicorn

    from kvpath.cli import main

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.delenv("KVPATH_ENGINE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    base = ["proxy", "--prefill", "http://127.0.0.1:1,kv_addr=127.0.0.1:2", "--decode", "http://127.0.0.1:3"]
    f = tmp_path / "engine-key"
    f.write_text(KEY)
    assert main(base + ["--engine-api-key-file", str(f)]) == 0
    monkeypatch.setenv("KVPATH_ENGINE_API_KEY", "from-env")
    assert main(base) == 0
    monkeypatch.delenv("KVPATH_ENGINE_API_KEY")
    assert main(base) == 0
    keys = [app.proxy.cfg.engine_api_key for app in apps]
    assert keys == [KEY, "from-env", None]
    assert apps[0].proxy.engine_headers == {"Authorization": f"Bearer {KEY}"} and apps[2].proxy.engine_headers == {}
    with pytest.raises(SystemExit, match="--engine-api-key-file: cannot read"):
        main(base + ["--engine-api-key-file", str(tmp_path / "missing")])


def test_there_is_no_option_that_takes_the_key_itself():
    import argparse

    from kvpath.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    opts = [o for a in sub.choices["proxy"]._actions for o in a.option_strings]
    assert "--engine-api-key-file" in opts
    assert not [o for o in opts if "key" in o and not o.endswith("-file")]


def test_vllm_server_passes_its_key_in_the_environment_never_in_argv(tmp_path, monkeypatch):
    from kvpath.testbed import vllm_server
    from kvpath.testbed.vllm_server import VLLMServer

    started = []

    class FakePopen:
        def __init__(self, argv, env=None, **kw):
            started.append((argv, env))
            self.pid = 0

    monkeypatch.setattr(vllm_server, "vllm_executable", lambda: "/bin/vllm")
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    srv = VLLMServer(str(tmp_path / "model"), 8123, api_key=KEY).start()
    argv, env = started[0]
    assert env["VLLM_API_KEY"] == KEY and not any(KEY in a for a in argv) and "--api-key" not in argv
    assert srv.headers == {"Authorization": f"Bearer {KEY}"} and KEY not in repr(srv)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    plain = VLLMServer(str(tmp_path / "model"), 8124).start()
    assert "VLLM_API_KEY" not in started[1][1] and plain.headers == {}


def _site(tmp_path: Path, **kw):
    from kvpath.testbed.engines import RunSite
    from kvpath.testbed.run_config import RunConfig

    cfg = RunConfig(out=str(tmp_path), **kw)
    spec, _, _ = cfg.validate()
    fabric = SimpleNamespace(spec=spec, prefix="kvp-test", MGMT_ROOT_IP="10.255.0.1",
                             mgmt_ip=lambda h: f"10.254.0.{spec.hosts().index(h) + 2}",
                             exec_argv=lambda h, argv: ["ip", "netns", "exec", f"kvp-test-{h}", *argv])
    return RunSite(fabric, cfg, ["l0h0"], ["l1h0"], tmp_path / "fabric.json", tmp_path)


@pytest.mark.parametrize("connector, mode", [("kvpath", "cc"), ("nixl", "ecmp"), ("nixl-push", "ecmp")])
def test_the_testbed_runs_vllm_with_a_key_and_gives_the_proxy_its_file(tmp_path, monkeypatch, connector, mode):
    import os

    from kvpath.testbed.engine_kinds import engines_for
    from kvpath.testbed.orchestrator import proxy_argv
    from kvpath.testbed.vllm_engines import VllmEngines

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    site = _site(tmp_path, engine="vllm", connector=connector, mode=mode)
    engines = VllmEngines(site)
    argv = proxy_argv(site, engines)
    key_file = Path(argv[argv.index("--engine-api-key-file") + 1])
    key = key_file.read_text().strip()
    assert len(key) >= 24 and key_file.stat().st_mode & 0o077 == 0
    assert not any(key in a for a in argv)
    for pl in engines.placements():
        srv = engines.server(pl, "/m/tiny", "http://10.255.0.1:18000")
        assert srv.api_key == key and not any(key in a for a in srv.command())
    assert VllmEngines(site).api_key == key  # one key per run
    # emulated engines have no API key: the proxy gets none
    assert "--engine-api-key-file" not in proxy_argv(site, engines_for(_site(tmp_path / "emu")))
