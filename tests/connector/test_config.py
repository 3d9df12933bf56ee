import pytest

from kvpath.connector.config import ConfigError, KVPathConfig, parse_host_port

PLAIN = {"control_plaintext": True}  # loopback (the default side channel host)


def test_defaults_are_seconds_not_minutes():
    cfg = KVPathConfig.from_extra_config(PLAIN)
    assert cfg.lease_timeout_s <= 60 and cfg.registration_timeout_s <= 60
    assert cfg.lanes >= 1


def test_known_knobs_are_parsed_and_coerced():
    cfg = KVPathConfig.from_extra_config({"lanes": 2, "lease_timeout_s": 3, "trace_path": "/tmp/t.jsonl", **PLAIN})
    assert cfg.lanes == 2 and cfg.lease_timeout_s == 3.0 and isinstance(cfg.lease_timeout_s, float)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"lane": 2}, "lane"),
        ({"lanes": "4"}, "lanes"),
        ({"lanes": 0}, "lanes"),
        ({"lanes": True}, "lanes"),
        ({"lease_timeout_s": "10s"}, "lease_timeout_s"),
        ({"registration_timeout_s": -1}, "registration_timeout_s"),
        ({"side_channel_port": 70000}, "side_channel_port"),
        ({"trace_path": 5}, "trace_path"),
        ({"ucx_transport": ""}, "ucx_transport"),
        ({"max_wait_s": 5, "registration_timeout_s": 10}, "max_wait_s"),
        ({"registration_timeout_s": 0.05}, "registration_timeout_s"),
        ({"registration_timeout_s": 1000, "max_wait_s": 2000}, "registration_timeout_s"),
        ({"max_wait_s": 1e9}, "max_wait_s"),
        ({"fabric_spec": "/tmp/f.json"}, "fabric_host"),
        ({"lane_candidates": 0}, "lane_candidates"),
        ({"fence_grace_s": 0}, "fence_grace_s"),
    ],
)
def test_bad_config_names_the_field(extra, field):
    with pytest.raises(ConfigError) as e:
        KVPathConfig.from_extra_config({**PLAIN, **extra})
    assert field in str(e.value)


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:5600") == ("127.0.0.1", 5600)
    for bad in ("nohost", ":5600", "h:0", "h:x", None):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_missing_nixl_is_a_clear_startup_error(monkeypatch):
    import builtins

    from kvpath.connector import nixl_io

    real_import = builtins.__import__

    def no_nixl(name, *a, **kw):
        if name.startswith("nixl"):
            raise ImportError("No module named 'nixl'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(ConfigError, match="needs NIXL"):
        nixl_io.load_nixl()


def test_reserve_at_is_validated():
    with pytest.raises(ConfigError, match="reserve_at must be admission or push"):
        KVPathConfig.from_extra_config({"reserve_at": "later", **PLAIN})
    with pytest.raises(ConfigError, match="reserve_at=push needs reservation_url and fabric_host"):
        KVPathConfig.from_extra_config({"reserve_at": "push", "reservation_url": "http://x/reservation", **PLAIN})
    cfg = KVPathConfig.from_extra_config({"reserve_at": "push", "reservation_url": "http://x/reservation",
                                          "fabric_host": "l0h0", **PLAIN})
    assert cfg.reserve_at == "push"
    with pytest.raises(ConfigError, match="kernel_oracle needs fabric_spec"):
        KVPathConfig.from_extra_config({"kernel_oracle": "kvp-ab12", **PLAIN})


def test_the_control_channel_needs_keys_or_loopback_plaintext(tmp_path):
    from kvpath.connector.control_auth import ControlKeys, pd_keys

    with pytest.raises(ConfigError, match="control_key: the control channel needs keys"):
        KVPathConfig.from_extra_config({})
    with pytest.raises(ConfigError, match="control_plaintext works on loopback only"):
        KVPathConfig.from_extra_config({"control_plaintext": True, "side_channel_host": "10.0.0.1"})
    knobs = pd_keys(tmp_path)
    with pytest.raises(ConfigError, match="control_key and control_trusted_keys go together"):
        KVPathConfig.from_extra_config({"control_key": knobs["p"]["control_key"]})
    with pytest.raises(ConfigError, match="either keys or plaintext"):
        KVPathConfig.from_extra_config({**knobs["p"], "control_plaintext": True})
    cfg = KVPathConfig.from_extra_config({**knobs["p"], "side_channel_host": "10.0.0.1"})
    p = ControlKeys.load(cfg.control_key, cfg.control_trusted_keys)
    d = ControlKeys.load(knobs["d"]["control_key"], knobs["d"]["control_trusted_keys"])
    assert p.trusted == {d.public} and d.trusted == {p.public} and p.public != d.public
    with pytest.raises(ValueError, match="control_key: .* holds no secret key"):
        ControlKeys.load(str(tmp_path / "prefill.key"), knobs["p"]["control_trusted_keys"])
    with pytest.raises(ValueError, match="control_trusted_keys: .* is not a directory"):
        ControlKeys.load(knobs["p"]["control_key"], str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="control_trusted_keys: no \\*.key file"):
        ControlKeys.load(knobs["p"]["control_key"], str(tmp_path / "empty"))


def test_p_never_advertises_a_wildcard_address():
    from kvpath.connector.config import KVPathConfig, parse_host_port

    wild = KVPathConfig(side_channel_host="0.0.0.0", side_channel_port=5600)
    host, port = parse_host_port(wild.advertised_addr(1))
    assert port == 5601 and host not in ("0.0.0.0", "")
    assert KVPathConfig(side_channel_host="0.0.0.0", advertise_host="10.1.2.3").advertised_addr() == "10.1.2.3:5600"
    assert KVPathConfig(side_channel_host="10.9.9.9").advertised_addr() == "10.9.9.9:5600"
