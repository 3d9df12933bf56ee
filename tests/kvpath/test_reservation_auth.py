"""The reservation service's credential (issue 32, finding 3): every call but /health and
/metrics needs the token, standalone or mounted in the proxy; neither starts without
one; a reservation names only registered lanes and bounded bytes; the clients send the
token, which no started process gets on its command line."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvpath.fabric import FabricSpec
from kvpath.reservation import wire
from kvpath.reservation.app import create_app
from kvpath.reservation.decisions import ReservationError, ReservationService

SPEC = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
TOKEN = "s3cret-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LANES = [{"lane": i, "src_port": 40000 + i} for i in range(4)]
LANES_BODY = {"src_host": "l0h0", "dst_host": "l1h0", "lanes": LANES}
RESERVE = {"src_host": "l0h0", "dst_host": "l1h0", "bytes": 5}

# every guarded call: (method, path, body); the body is valid, so only the token decides
GUARDED = [
    ("POST", "/v1/lanes", LANES_BODY),
    ("POST", "/v1/lanes/unregister", {"src_host": "l0h0", "dst_host": "l1h0", "worker": ""}),
    ("GET", "/v1/state", None),
    ("GET", "/v1/decisions", None),
    ("POST", "/v1/reserve", RESERVE),
    ("POST", "/v1/release", {"lease_id": "r1-000000000000"}),
]


def _call(c, method, path, body, headers=None):
    return c.request(method, path, json=body, headers=headers or {})


def _service_with_a_lease():
    svc = ReservationService(SPEC, "cc", lease_s=30)
    svc.register_lanes("l0h0", "l1h0", [wire.LaneInfo(**x) for x in LANES])
    lease = svc.reserve("l0h0", "l1h0", 1000, transfer_id="victim").lease_id
    return svc, lease


@pytest.mark.parametrize("method, path, body", GUARDED)
def test_a_missing_or_wrong_token_is_401_on_every_call_but_health_and_metrics(method, path, body):
    svc, lease = _service_with_a_lease()
    with TestClient(create_app(svc, token=TOKEN)) as c:
        if path == "/v1/release":
            body = {"lease_id": lease}  # a real lease of another client: not ended without the token
        for headers in (None, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN},
                        {"Authorization": "Bearer "}):
            r = _call(c, method, path, body, headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in r.text
        # nothing changed: the victim's lease and the registry are as they were
        assert lease in svc.active and len(svc.active) == 1 and len(svc.lanes("l0h0", "l1h0")) == 4
        assert svc.counters["reservations"] == 1
        assert _call(c, method, path, body, AUTH).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_a_service_built_without_a_token_closes_every_call_but_health_and_metrics():
    svc, lease = _service_with_a_lease()
    with TestClient(create_app(svc)) as c:
        for method, path, body in GUARDED:
            for headers in (None, AUTH, {"Authorization": "Bearer "}):
                r = _call(c, method, path, body, headers)
                assert r.status_code == 403 and "disabled" in r.text and wire.TOKEN_ENV in r.text, (path, r.text)
        assert lease in svc.active and svc.counters["reservations"] == 1
        assert c.get("/health").json()["status"] == "ok" and c.get("/metrics").status_code == 200


def test_the_replayed_attack_needs_the_token():
    """Finding 3 replayed without the token: read the lanes, forge lanes, read the
    decisions, release another client's lease, unregister real lanes. All refused."""
    svc, lease = _service_with_a_lease()
    with TestClient(create_app(svc, token=TOKEN)) as c:
        assert c.get("/v1/state").status_code == 401
        forged = {"src_host": "l0h0", "dst_host": "l1h0", "lanes": [{"lane": 0, "src_port": 40000}]}
        assert c.post("/v1/lanes", json=forged).status_code == 401
        assert c.post("/v1/reserve", json={**RESERVE, "lanes": forged["lanes"]}).status_code == 401
        assert c.get("/v1/decisions").status_code == 401
        assert c.post("/v1/release", json={"lease_id": lease}).status_code == 401
        assert c.post("/v1/lanes/unregister", json={"src_host": "l0h0", "dst_host": "l1h0"}).status_code == 401
    assert lease in svc.active and len(svc.lanes("l0h0", "l1h0")) == 4
    assert svc.counters["lane_registrations"] == 1 and svc.counters["reservations"] == 1


def test_a_reservation_names_only_lanes_registered_for_its_pair():
    svc = ReservationService(SPEC, "cc", lease_s=30)
    svc.register_lanes("l0h0", "l1h0", [wire.LaneInfo(0, 40000), wire.LaneInfo(1, 40001)],
                       pair=wire.WorkerPair(p_engine="p", d_engine="d"))
    with TestClient(create_app(svc, token=TOKEN), headers=AUTH) as c:
        # made up: a port P never opened, a lane id it does not have, another pair's lanes
        for lanes, body in (([{"lane": 0, "src_port": 40999}], RESERVE),
                            ([{"lane": 7, "src_port": 40000}], RESERVE),
                            ([{"lane": 0, "src_port": 40000, "dst_port": 1}], RESERVE),
                            ([{"lane": 0, "src_port": 40000, "src_ip": "10.9.9.9"}], RESERVE),
                            ([{"lane": 0, "src_port": 40000}], {**RESERVE, "dst_host": "l1h1"}),
                            ([{"lane": 0, "src_port": 40000}], {**RESERVE, "scope": {"p_engine": "other"}})):
            r = c.post("/v1/reserve", json={**body, "lanes": lanes})
            assert r.status_code == 422 and r.json()["fields"] == ["lanes"], (lanes, r.text)
        assert not svc.active and svc.counters["reservations"] == 0
        # a registered subset narrows the candidates (in scope, with the fields P registered)
        r = c.post("/v1/reserve", json={**RESERVE, "scope": {"p_engine": "p"},
                                         "lanes": [{"lane": 1, "src_port": 40001, "proto": "tcp"}]})
        assert r.status_code == 200 and r.json()["lane"] == 1
        m = c.get("/metrics").text
        assert 'kvpath_reservations_total{mode="cc",outcome="rejected"} 6.0' in m


@pytest.mark.parametrize("nbytes", [(1 << 40) + 1, 10**30, -1])
def test_bytes_are_bounded(nbytes):
    svc = ReservationService(SPEC, "cc", lease_s=30)
    svc.register_lanes("l0h0", "l1h0", [wire.LaneInfo(**x) for x in LANES])
    with TestClient(create_app(svc, token=TOKEN), headers=AUTH) as c:
        r = c.post("/v1/reserve", json={**RESERVE, "bytes": nbytes})
        assert r.status_code == 422 and r.json()["fields"] == ["bytes"], r.text
        assert c.post("/v1/reserve", json={**RESERVE, "bytes": 1 << 40}).status_code == 200
    assert len(svc.active) == 1
    with pytest.raises(ReservationError, match="bytes"):  # the in-process service too (the proxy's inproc)
        svc.reserve("l0h0", "l1h0", (1 << 40) + 1)


# ---- the commands ------------------------------------------------------------
def _run(monkeypatch, argv, env=None):
    """``kvpath ARGV`` with uvicorn.run caught: the app it would serve."""
    import uvicorn

    from kvpath.cli import main

    for k in (wire.TOKEN_ENV, "KVPATH_ADMIN_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert main(argv) == 0
    return apps[0]


def _secret(tmp_path, name="token", value=TOKEN):
    from kvpath.credentials import write_secret_file

    return str(write_secret_file(tmp_path / name, value))


def test_the_reservation_command_refuses_to_start_without_a_token(monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, ["reservation", "--port", "1"])
    msg = str(e.value)
    assert msg.startswith("kvpath reservation: error:") and "--token-file" in msg and wire.TOKEN_ENV in msg
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "latin").write_text("t\u00f6ken\n")
    for bad in (tmp_path / "missing", tmp_path / "empty", tmp_path / "latin"):
        with pytest.raises(SystemExit) as e:
            _run(monkeypatch, ["reservation", "--port", "1", "--token-file", str(bad)])
        assert str(e.value).startswith("kvpath reservation: error: --token-file:")
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, ["reservation", "--port", "1"], {wire.TOKEN_ENV: "two words"})
    assert str(e.value) == f"kvpath reservation: error: ${wire.TOKEN_ENV}: a token must be one word of printable ASCII"


@pytest.mark.parametrize("how", ["file", "env", "argv"])
def test_the_reservation_command_takes_its_token_from_a_file_or_the_environment(monkeypatch, tmp_path, caplog, how):
    argv, env = ["reservation", "--port", "1"], {}
    if how == "file":
        argv += ["--token-file", _secret(tmp_path)]
    elif how == "env":
        env = {wire.TOKEN_ENV: TOKEN}
    else:  # the deprecated alias still works, with a warning that does not repeat the token
        argv += [f"--admin-token={TOKEN}"]
    with caplog.at_level(logging.WARNING):
        app = _run(monkeypatch, argv, env)
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert bool(warned) == (how == "argv") and not any(TOKEN in w for w in warned)
    if warned:
        assert "--token-file" in warned[0] and "every local user" in warned[0]
    with TestClient(app) as c:
        assert c.post("/v1/lanes", json=LANES_BODY).status_code == 401
        assert c.post("/v1/lanes", json=LANES_BODY, headers=AUTH).status_code == 200
        assert c.post("/v1/reserve", json=RESERVE).status_code == 401
        assert c.post("/v1/reserve", json=RESERVE, headers=AUTH).json()["lane"] is not None


PROXY = ["proxy", "--port", "1", "--health-interval-s", "0",
         "--prefill", "http://127.0.0.1:1,kv_addr=127.0.0.1:2,fabric_host=l0h0",
         "--decode", "http://127.0.0.1:3,fabric_host=l1h0"]


def test_the_proxy_refuses_a_reservation_service_without_a_token(monkeypatch, tmp_path):
    for extra in (["--reservation", "inproc"], ["--reservation-url", "http://127.0.0.1:8900"],
                  ["--reservation", "inproc", "--admin-token-file", _secret(tmp_path, "admin", "adm1n")]):
        with pytest.raises(SystemExit) as e:
            _run(monkeypatch, PROXY + extra)
        msg = str(e.value)
        assert msg.startswith("kvpath proxy: error:") and "--reservation-token-file" in msg and wire.TOKEN_ENV in msg
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, PROXY + ["--reservation", "inproc", "--reservation-token-file", str(tmp_path / "nope")])
    assert str(e.value).startswith("kvpath proxy: error: --reservation-token-file: cannot read")
    # reserve_at=push: the proxy never calls --reservation-url, so it needs no token for it
    _run(monkeypatch, PROXY + ["--reservation-url", "http://127.0.0.1:8900", "--reserve-at", "push"])


@pytest.mark.parametrize("how", ["file", "env"])
def test_the_proxys_mounted_service_needs_the_reservation_token_and_admin_its_own(monkeypatch, tmp_path, how):
    env = {}
    argv = PROXY + ["--reservation", "inproc"]
    if how == "file":
        argv += ["--reservation-token-file", _secret(tmp_path), "--admin-token-file", _secret(tmp_path, "a", "adm1n")]
    else:
        env = {wire.TOKEN_ENV: TOKEN, "KVPATH_ADMIN_TOKEN": "adm1n"}
    app = _run(monkeypatch, argv, env)
    with TestClient(app) as c:
        for method, path, body in GUARDED:
            r = _call(c, method, "/reservation" + path, body)
            assert r.status_code == 401, (path, r.text)
            assert _call(c, method, "/reservation" + path, body, {"Authorization": "Bearer adm1n"}).status_code == 401
        assert c.post("/reservation/v1/lanes", json=LANES_BODY, headers=AUTH).status_code == 200
        assert c.get("/reservation/v1/state", headers=AUTH).json()["lanes_known"]
        assert c.get("/reservation/health").status_code == 200 and c.get("/reservation/metrics").status_code == 200
        # /admin: its own token, not the reservation service's
        add = {"role": "decode", "url": "http://127.0.0.1:4", "fabric_host": "l1h1"}
        assert c.post("/admin/instances", json=add, headers=AUTH).status_code == 401
        assert c.post("/admin/instances", json=add, headers={"Authorization": "Bearer adm1n"}).status_code == 201


def test_the_proxys_deprecated_admin_token_guards_admin_only(monkeypatch, caplog):
    """The old --admin-token still works for /admin (with a warning), but is never the
    reservation token: every P connector holds that one, and must not hold /admin."""
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit, match="--reservation-token-file"):
        _run(monkeypatch, PROXY + ["--reservation", "inproc", "--admin-token", TOKEN])
    assert any("--admin-token is deprecated" in r.getMessage() for r in caplog.records)
    assert not any(TOKEN in r.getMessage() for r in caplog.records)
    app = _run(monkeypatch, PROXY + ["--reservation", "inproc", "--admin-token", TOKEN], {wire.TOKEN_ENV: "res-" + TOKEN})
    with TestClient(app) as c:
        assert c.get("/reservation/v1/state", headers=AUTH).status_code == 401
        assert c.get("/reservation/v1/state", headers={"Authorization": f"Bearer res-{TOKEN}"}).status_code == 200
        add = {"role": "decode", "url": "http://127.0.0.1:4", "fabric_host": "l1h1"}
        assert c.post("/admin/instances", json=add, headers=AUTH).status_code == 201


def test_the_proxy_sends_its_reservation_token_to_a_reservation_url(monkeypatch):
    from kvpath.reservation import clients as reservation_client

    made = []
    real = reservation_client.HttpReserver

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(reservation_client, "HttpReserver", spy)
    _run(monkeypatch, PROXY + ["--reservation-url", "http://127.0.0.1:8900"], {wire.TOKEN_ENV: TOKEN})
    assert made and made[0].headers["authorization"] == f"Bearer {TOKEN}"


# ---- the clients -----------------------------------------------------------
def test_http_reserver_sends_the_token_on_reserve_and_release():
    from kvpath.reservation.clients import HttpReserver
    from tests.kvpath.test_reservation_app import _recording_service

    seen, srv = _recording_service()

    async def go():
        res = HttpReserver(srv.url, token=TOKEN, timeout_s=10)
        grant = await res.reserve("l0h0", "l1h0", 5, transfer_id="t1")
        await res.release("r1-ab")
        await res.close()
        return grant

    with srv:
        assert asyncio.run(go()).lane == 3
    assert [(x[0], x[2]) for x in seen] == [(wire.RESERVE_PATH, f"Bearer {TOKEN}"), (wire.RELEASES_PATH, f"Bearer {TOKEN}")]


def test_http_reserver_against_the_real_service():
    from kvpath.reservation.clients import HttpReserver

    svc = ReservationService(SPEC, "cc", lease_s=30)
    svc.register_lanes("l0h0", "l1h0", [wire.LaneInfo(**x) for x in LANES])
    app = create_app(svc, token=TOKEN)

    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    srv = ServerThread(app, free_port())

    async def go(token):
        res = HttpReserver(srv.url, token=token, timeout_s=10)
        grant = await res.reserve("l0h0", "l1h0", 5, transfer_id="t1")
        if grant.lease_id:
            await res.release(grant.lease_id)
        await res.close()
        return grant

    with srv:
        assert asyncio.run(go(None)).fallback == "http_401"
        assert asyncio.run(go("wrong")).fallback == "http_401"
        assert asyncio.run(go(TOKEN)).lane is not None
    assert not svc.active and svc.counters["releases"] == 1


def _cfg(**knobs):
    from kvpath.connector.config import KVPathConfig

    return KVPathConfig.from_extra_config({"control_plaintext": True, "reservation_url": "http://127.0.0.1:1",
                                           **knobs})


def test_p_connector_reads_its_token_from_a_file_or_the_environment(tmp_path, monkeypatch, caplog):
    from kvpath.connector.config import ConfigError
    from kvpath.credentials import CredentialError
    from kvpath.reservation.notifier import reservation_token

    monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
    assert reservation_token(_cfg()) is None
    assert reservation_token(_cfg(reservation_token_file=_secret(tmp_path))) == TOKEN
    assert reservation_token(_cfg(), environ={wire.TOKEN_ENV: TOKEN}) == TOKEN
    monkeypatch.setenv(wire.TOKEN_ENV, "from-env")
    assert reservation_token(_cfg()) == "from-env"
    assert reservation_token(_cfg(reservation_token_file=_secret(tmp_path))) == TOKEN  # the file first
    # the literal knob: deprecated, a warning that names the new ways and not the token
    with caplog.at_level(logging.WARNING):
        assert reservation_token(_cfg(reservation_token="lit3ral")) == "lit3ral"
    (w,) = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert "reservation_token_file" in w and wire.TOKEN_ENV in w and "lit3ral" not in w
    # a bad file fails at start-up naming the knob; the two knobs together are refused
    with pytest.raises(ConfigError, match="reservation_token_file.*cannot read"):
        _cfg(reservation_token_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="reservation_token_file"):
        _cfg(reservation_token_file=_secret(tmp_path), reservation_token="x")
    with pytest.raises(CredentialError, match="reservation_token_file: a token must be one word"):
        reservation_token(_cfg(reservation_token_file=_secret(tmp_path, value="t\u00f6ken")))
    with pytest.raises(CredentialError, match=f"{wire.TOKEN_ENV}: a token must be one word"):
        reservation_token(_cfg(), environ={wire.TOKEN_ENV: "two words"})


def test_p_connector_sends_the_token_on_every_call():
    import threading
    import time

    from kvpath.reservation.notifier import ReservationNotifier
    from kvpath.testbed.readiness import free_port
    from kvpath.testbed.stub_engine import ServerThread

    svc = ReservationService(SPEC, "cc", lease_s=30)
    got, done = [], threading.Event()
    with ServerThread(create_app(svc, token=TOKEN), free_port()) as srv:
        n = ReservationNotifier(srv.url, token=TOKEN)
        n.register_lanes("l0h1", "l1h1", [(0, 41000), (1, 41001)])
        time.sleep(0.5)  # the registration is on the other thread: let it land first
        n.reserve("l0h1", "l1h1", 1000, transfer_id="t1", done=lambda *a: (got.append(a), done.set()))
        assert done.wait(5) and got[0][1] in (0, 1) and got[0][2] in svc.active
        n.release(got[0][2])
        n.close()
        assert n.stats.totals["reservation_calls_ok"] == 3 and not svc.active
        stranger = ReservationNotifier(srv.url)  # no token: every call refused
        stranger.register_lanes("l0h1", "l1h1", [(0, 1)])
        stranger.close()
        assert stranger.stats.totals["reservation_calls_failed"] == 1 and svc.lanes("l0h1", "l1h1")[0].src_port == 41000


# ---- no started process gets the token on its command line ---------------------
def _site(tmp_path):
    from types import SimpleNamespace

    from kvpath.testbed.engines import RunSite
    from kvpath.testbed.run_config import RunConfig

    cfg = RunConfig(out=str(tmp_path))
    spec, _, _ = cfg.validate()
    fabric = SimpleNamespace(spec=spec, prefix="kvp-test", MGMT_ROOT_IP="10.255.0.1",
                             mgmt_ip=lambda h: f"10.254.0.{spec.hosts().index(h) + 2}",
                             exec_argv=lambda host, argv: argv)
    return RunSite(fabric, cfg, ["l0h0"], ["l1h0"], tmp_path / "fabric.json", tmp_path)


def test_the_testbed_hands_the_token_over_in_a_0600_file_never_in_argv(tmp_path, monkeypatch):
    from kvpath.cli import build_parser
    from kvpath.testbed import vllm_server
    from kvpath.testbed.engine_kinds import engines_for
    from kvpath.testbed.orchestrator import proxy_argv
    from kvpath.testbed.vllm_engines import VllmEngines

    site = _site(tmp_path)
    argv = proxy_argv(site, engines_for(site))
    token = site.admin_token
    f = Path(argv[argv.index("--reservation-token-file") + 1])
    assert f.stat().st_mode & 0o777 == 0o600 and f.read_text().strip() == token
    assert not any(token in a for a in argv) and not any(a.startswith("--admin-token") for a in argv)
    args = build_parser().parse_args(argv[argv.index("proxy"):])
    assert args.reservation_token_file == str(f) and args.admin_token is None
    eargv = engines_for(site)._argv("prefill", "l0h0", "http://10.255.0.1:18000")  # the emulated engines
    assert not any(token in a for a in eargv) and eargv[eargv.index("--reservation-token-file") + 1] == str(f)
    # vLLM engines: the knob names the file; vLLM's command line (and its log) never has the token
    monkeypatch.setattr(vllm_server, "vllm_executable", lambda: "vllm")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    vsite = _site(tmp_path / "v")
    engines = VllmEngines(vsite)
    pl = engines.placements()[0]
    server = engines.server(pl, "/models/tiny", "http://10.255.0.1:18000")
    extra = server.kv_transfer_config["kv_connector_extra_config"]
    assert extra["reservation_token_file"] == str(vsite.token_file) and "reservation_token" not in extra
    assert not any(vsite.admin_token in a for a in server.command())
