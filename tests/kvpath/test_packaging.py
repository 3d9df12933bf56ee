"""kvpath installs as one namespace and as a vLLM plugin.

The wheel is built from a copy of the source tree and installed with ``--no-deps`` into
a fresh virtual environment that sees the project's pinned vLLM through a ``.pth`` file
(nothing large is installed twice); every check then runs from a temporary directory, so
the repository root is not on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD_TOP_LEVEL = ("connector", "proxy", "testbed", "simulator_bridge")


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv[:4]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "out", "build", "dist",
                                                             "*.egg-info", "__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(wheels), str(src)], cwd=tmp)
    (wheel,) = wheels.glob("kvpath-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip())
    # vLLM, NIXL and the rest come from the project's environment, after the new venv's own packages
    (site / "project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=tmp)
    work = tmp / "cwd"
    work.mkdir()
    return {"wheel": wheel, "py": py, "site": site, "cwd": work}


def test_the_wheel_adds_one_top_level_package(installed):
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvpath"}
    for part in ("connector", "proxy", "testbed", "bridge"):
        assert f"kvpath/{part}/__init__.py" in names
    assert "kvpath/bridge/ns3/kvflows.cc" in names  # the ns-3 scenario is compiled on first use
    assert "kvpath/tiny_model/data/corpus.txt" in names  # the text the tiny model trains on
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(installed["wheel"]) as z:
        text = z.read(ep).decode()
    assert "[vllm.general_plugins]" in text and "kvpath.connector.plugin:register" in text


def test_old_top_level_names_do_not_import_and_kvpath_comes_from_the_wheel(installed):
    code = textwrap.dedent(f"""
        import importlib, json
        out = {{}}
        for name in {OLD_TOP_LEVEL!r}:
            try:
                importlib.import_module(name)
                out[name] = "imported"
            except ModuleNotFoundError:
                out[name] = "missing"
        import kvpath.connector, kvpath.proxy, kvpath.testbed, kvpath.bridge
        out["files"] = [m.__file__ for m in (kvpath.connector, kvpath.proxy, kvpath.testbed, kvpath.bridge)]
        print(json.dumps(out))
    """)
    out = json.loads(_run([str(installed["py"]), "-c", code], cwd=installed["cwd"]).stdout.strip().splitlines()[-1])
    assert {n: out[n] for n in OLD_TOP_LEVEL} == {n: "missing" for n in OLD_TOP_LEVEL}
    assert all(f.startswith(str(installed["site"])) for f in out["files"]), out["files"]


def test_vllm_loads_the_plugin_and_the_hook_stays_light(installed):
    code = textwrap.dedent("""
        import json, sys
        import kvpath.connector.plugin as plugin
        light = sorted(m for m in sys.modules if m.split(".")[0] in ("nixl", "nixl_cu12", "zmq", "vllm", "torch"))
        from vllm.plugins import load_general_plugins
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        before = set(sys.modules)
        load_general_plugins()
        plugin.register()  # a second load does nothing (register_connector would raise on a repeat)
        new = sorted(set(sys.modules) - before)
        cls = KVConnectorFactory._registry["KVPathConnector"]()
        print(json.dumps({"light": light, "new": new, "cls": f"{cls.__module__}.{cls.__qualname__}",
                          "file": sys.modules[cls.__module__].__file__}))
    """)
    out = json.loads(_run([str(installed["py"]), "-c", code], cwd=installed["cwd"]).stdout.strip().splitlines()[-1])
    assert out["light"] == []  # importing the plugin module pulls in neither NIXL, ZMQ, vLLM nor torch
    assert "kvpath.connector.plugin" not in out["new"]  # already imported above: the hook imported nothing of ours
    assert not [m for m in out["new"] if m.split(".")[0] in ("nixl", "nixl_cu12") or m.startswith("kvpath.connector.")]
    assert out["cls"] == "kvpath.connector.vllm_connector.KVPathConnector"
    assert out["file"].startswith(str(installed["site"]))
