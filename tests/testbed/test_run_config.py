"""A testbed run's configuration: every bad combination names its flag, and each engine
kind gets its defaults (no fabric, no engine started)."""

from __future__ import annotations

import pytest

from kvpath.testbed.run_config import ENGINE_DEFAULTS, RunConfig, RunConfigError


@pytest.mark.parametrize("kw, field", [
    (dict(engine="vllm", connector="nixl", mode="cc"), "--connector nixl"),
    (dict(engine="vllm", scale_s=4.0), "--scale-s"),
    (dict(engine="vllm", pools="8P8D", fabric="rack4"), "--pools"),
    (dict(engine="vllm", max_prompt=2040, max_output=64), "--max-prompt"),
    (dict(engine="emulated", connector="nixl"), "--connector"),
    (dict(engine="gpu"), "--engine"),
    (dict(min_prompt=500, max_prompt=100), "--min-prompt"),
    (dict(engine="vllm", tp="2:1", connector="nixl", mode="ecmp"),
     r"--tp 2:1: --connector nixl needs equal TP sizes here \(P 2, D 1\)"),
    (dict(engine="vllm", tp="2x2"), "--tp: give P:D TP sizes such as 2:2"),
    (dict(engine="vllm", tp="0:0"), "--tp: give P:D TP sizes from 1 to 8"),
    (dict(engine="vllm", tp="1:2:3"), "--tp"),
    (dict(tp="2:2"), "--tp applies to --engine vllm only"),
])
def test_bad_run_configs_name_the_field(tmp_path, kw, field):
    with pytest.raises(RunConfigError, match=field):
        RunConfig(out=str(tmp_path), **kw).validate()


def test_vllm_defaults_fit_the_tiny_model(tmp_path):
    cfg = RunConfig(out=str(tmp_path), engine="vllm")
    cfg.validate()
    assert (cfg.min_prompt, cfg.max_prompt, cfg.scale_s) == (128, 1024, 1.0)
    emu = RunConfig(out=str(tmp_path))
    emu.validate()
    assert (emu.min_prompt, emu.max_prompt, emu.scale_s) == (1024, 4096, 500.0)


@pytest.mark.parametrize("kw, field", [
    (dict(pools="8P"), "--pools"),
    (dict(pools="0P1D"), "--pools"),
    (dict(pools="9P9D"), "--pools 9P9D do not fit: 2 hosts for P and 2 for D"),
    (dict(mode="spray"), "--mode"),
    (dict(reserve_at="later"), "--reserve-at"),
    (dict(cc_metric="packets"), "--cc-metric"),
    (dict(policy="random"), "--policy"),
    (dict(qps=0), "--qps"),
    (dict(requests=0), "--requests"),
    (dict(fabric="no-such-preset"), "--fabric"),
])
def test_bad_shared_flags_name_the_field(tmp_path, kw, field):
    with pytest.raises(RunConfigError, match=field):
        RunConfig(out=str(tmp_path), **kw).validate()


def test_validate_returns_the_fabric_and_the_pools(tmp_path):
    spec, n_p, n_d = RunConfig(out=str(tmp_path), fabric="rack4", pools="2P3D").validate()
    assert (spec.leaves, n_p, n_d) == (4, 2, 3)


def test_explicit_values_win_over_the_engine_defaults(tmp_path):
    cfg = RunConfig(out=str(tmp_path), min_prompt=10, max_prompt=20, scale_s=7.0)
    cfg.validate()
    assert (cfg.min_prompt, cfg.max_prompt, cfg.scale_s) == (10, 20, 7.0)
    assert set(ENGINE_DEFAULTS) == {"emulated", "vllm"}


def test_only_the_kvpath_connector_pushes(tmp_path):
    assert RunConfig(out=str(tmp_path)).pushes
    assert not RunConfig(out=str(tmp_path), engine="vllm", connector="nixl", mode="ecmp").pushes


@pytest.mark.parametrize("tp", ["2:1", "1:2", "2:2"])
def test_kvpath_takes_unequal_tp_sizes_either_way(tmp_path, tp):
    cfg = RunConfig(out=str(tmp_path), engine="vllm", tp=tp)
    cfg.validate()
    assert cfg.tp_sizes == tuple(int(x) for x in tp.split(":"))
