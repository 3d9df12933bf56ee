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


def test_variants_name_their_policy_and_push_order_and_reach_the_engines(tmp_path):
    """--variants: each MODE[+layer][/POLICY][/ORDER N] is one run; its name (and folder)
    says the placement and the uplink cap; the emulated engines get the cap and order."""
    import dataclasses

    import pytest

    from kvpath.testbed.cli import parse_variant
    from kvpath.testbed.engine_kinds import engines_for
    from kvpath.testbed.run_config import RunConfig, RunConfigError
    from tests.kvpath.test_reservation_auth import _site

    assert parse_variant("ecmp/least_outstanding", "round_robin", "fifo") == (
        "ecmp", "request", "least_outstanding", "fifo", 0)
    assert parse_variant("cc+layer/joint/srpt1", "round_robin", "fifo") == ("cc", "layer", "joint", "srpt", 1)
    with pytest.raises(RunConfigError, match="--variants"):
        parse_variant("cc/fastest", "round_robin", "fifo")
    labels = [RunConfig(out="x", mode=m, push_granularity=g, policy=p, push_order=o, uplink_pushes=u).label
              for m, g, p, o, u in (parse_variant(v, "round_robin", "fifo")
                                    for v in ("ecmp/least_outstanding", "cc", "cc/joint", "cc/joint/srpt1"))]
    assert labels == ["ecmp", "cc", "cc/joint", "cc/joint/srpt1"]
    with pytest.raises(RunConfigError, match="push-order"):
        RunConfig(out=str(tmp_path), push_order="lifo").validate()
    site = _site(tmp_path)
    site = dataclasses.replace(site, cfg=dataclasses.replace(site.cfg, uplink_pushes=2, push_order="srpt"))
    argv = engines_for(site)._argv("prefill", "l0h0", "http://10.255.0.1:18000")
    assert argv[argv.index("--uplink-pushes") + 1] == "2" and argv[argv.index("--push-order") + 1] == "srpt"
    assert argv[argv.index("--uplink-slots-dir") + 1] == str(site.out)
