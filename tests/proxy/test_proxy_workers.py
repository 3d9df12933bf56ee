"""`kvpath proxy --workers N`: N processes on one address sharing one reservation
service, one /metrics view and one instance set (proxy/tier.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.proxy import instances
from kvpath.proxy.instances import Instance, InstancePool
from kvpath.proxy.tier import SharedInstances
from kvpath.reservation import wire
from kvpath.testbed.readiness import free_port, terminate, wait_http
from kvpath.testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app
from tests.proxy.test_proxy_tier import start_service

TOKEN, ADMIN = "r3s-t0ken-workers", "adm-t0ken-workers"


def _workers(parent: int) -> set[int]:
    """The live worker processes of a `kvpath proxy --workers N` (not its resource tracker,
    not a killed worker the parent has yet to reap)."""
    out = set()
    for c in psutil.Process(parent).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                out.add(c.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return out


def _every_worker_sees(url: str, admin: dict, check) -> dict[int, bool]:
    """Poll ``/status`` (a new connection each: any worker may answer) until every worker
    that answers passes ``check``, 20 answers in a row, or both workers were seen passing
    it (the workers follow the shared set every 0.5 s). Returns each seen worker's last."""
    seen: dict[int, bool] = {}
    streak, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline and streak < 20 and not (len(seen) == 2 and all(seen.values())):
        st = httpx.get(url + "/status", headers=admin, timeout=10).json()
        seen[st["worker_pid"]] = ok = check(st)
        streak = streak + 1 if ok else 0
        time.sleep(0.05)
    assert streak >= 20 or (len(seen) == 2 and all(seen.values())), seen
    return seen


def _pools(*insts: Instance) -> dict[str, InstancePool]:
    pools = {"prefill": InstancePool("prefill"), "decode": InstancePool("decode")}
    for i in insts:
        pools[i.role].add(i)
    return pools


def test_an_admin_change_in_one_worker_reaches_the_others_and_none_is_lost(tmp_path):
    p = Instance("http://p0", "prefill", "l0h0", "127.0.0.1:1")
    a, b = _pools(p, Instance("http://d0", "decode", "l1h0")), _pools(p, Instance("http://d0", "decode", "l1h0"))
    sa, sb = SharedInstances(tmp_path), SharedInstances(tmp_path)
    sa.publish(a)
    assert sb.sync(b)  # the first read: version 1, nothing to change but the version
    b["prefill"].all()[0].tp_size, b["prefill"].all()[0].tp_learned = 4, True  # what B learned of P
    sa.change(a, lambda: a["decode"].add(Instance("http://d1", "decode", "l1h1", engine_id="e1")))
    # B changes from a stale view: its change is made on the latest set (A's d1 is kept)
    sb.change(b, lambda: b["decode"].remove("http://d0"))
    assert sa.sync(a)
    for pools in (a, b):
        assert [i.url for i in pools["decode"].all()] == ["http://d1"]
        assert pools["decode"].all()[0].engine_id == "e1" and pools["decode"].all()[0].fabric_host == "l1h1"
    assert b["prefill"].all()[0].tp_size == 4  # unchanged by the operator: what B learned stays
    assert not sb.sync(b)  # nothing newer


def test_a_pool_is_bounded():
    pool = InstancePool("decode")
    for k in range(instances.MAX_INSTANCES):
        pool.add(Instance(f"http://d{k}", "decode"))
    with pytest.raises(ValueError, match="pool is full"):
        pool.add(Instance("http://one-more", "decode"))
    assert not pool.add(Instance("http://d0", "decode", "l1h0"))  # an update still goes through


@pytest.mark.parametrize("extra,needle", [(["--workers", "0"], "--workers must be from 1 to 64"),
                                          (["--workers", "2", "--reservation", "inproc"], "--reservation-url")])
def test_bad_worker_options_are_refused_naming_the_option(extra, needle):
    r = subprocess.run([sys.executable, "-m", "kvpath.cli", "proxy", "--prefill", "http://p,kv_addr=127.0.0.1:1",
                        "--decode", "http://d", *extra], capture_output=True, text=True, timeout=60,
                       env={**os.environ, wire.TOKEN_ENV: TOKEN})
    assert r.returncode != 0 and needle in r.stderr, r.stderr


def test_two_workers_on_one_address_share_decisions_metrics_and_instances(tmp_path):
    """Four requests at once through a two-worker proxy take the pair's four spines, one
    each (one reservation service decides for both workers); every scrape, whichever
    worker answers it, counts all four; an instance added through one worker is in
    every worker's set; a worker killed outright is replaced and the tier serves on."""
    env = {**os.environ, wire.TOKEN_ENV: TOKEN, "KVPATH_ADMIN_TOKEN": ADMIN}
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    # P answers after 1 s: the four reservations are all live when the last is decided
    p = ServerThread(create_stub_app("P0", StubBehaviour(delay_s=1.0)), free_port()).start()
    d = ServerThread(create_stub_app("D0", StubBehaviour()), free_port()).start()
    service, res_url, fabric = start_service(tmp_path, env)
    procs = [service]
    try:
        url = f"http://127.0.0.1:{free_port()}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port", url.rsplit(":", 1)[1],
             "--workers", "2", "--policy", "least_outstanding", "--fabric", str(fabric),
             "--prefill", f"{p.url},kv_addr=127.0.0.1:{KV_SIDE_CHANNEL_PORT},fabric_host=l0h0",
             "--decode", f"{d.url},fabric_host=l1h0", "--reservation-url", res_url,
             "--reservation-timeout-s", "10"], env=env))
        wait_http(url + "/health", procs[-1], timeout_s=90)
        workers = _workers(procs[-1].pid)
        assert len(workers) == 2, psutil.Process(procs[-1].pid).children()

        body = {"model": "tiny", "prompt": "spine leaf lane path push pull", "max_tokens": 4}
        with ThreadPoolExecutor(4) as ex:  # a client each: each its own connection
            answers = list(ex.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        log = httpx.get(res_url + wire.DECISIONS_PATH, headers=hdr, timeout=10).json()["decisions"]
        assert sorted(x["spine"] for x in log) == [f"spine{i}" for i in range(4)]  # one each: never stacked

        line = 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="200"} 4.0'
        for _ in range(6):  # a new connection each: any worker may answer, each sums all
            assert line in httpx.get(url + "/metrics", timeout=10).text.splitlines()

        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.post(url + "/admin/instances", headers=admin, timeout=10,
                       json={"role": "decode", "url": "http://127.0.0.1:9", "fabric_host": "l1h1"})
        assert r.status_code == 201, r.text
        seen = _every_worker_sees(url, admin, lambda st: "http://127.0.0.1:9" in [i["url"] for i in st["decode"]])
        assert set(seen) <= workers
        r = httpx.request("DELETE", url + "/admin/instances", headers=admin, timeout=10,
                          params={"role": "decode", "url": "http://127.0.0.1:9"})
        assert r.status_code == 200, r.text
        _every_worker_sees(url, admin, lambda st: [i["url"] for i in st["decode"]] == [d.url])

        # a worker killed outright: uvicorn starts another, the tier keeps serving, its
        # counters stay in the sums and its live gauges leave them at the next scrape
        metrics_dir = psutil.Process(next(iter(workers))).environ()["PROMETHEUS_MULTIPROC_DIR"]
        victim = min(workers)
        assert any(f.startswith("gauge_live") and f.endswith(f"_{victim}.db") for f in os.listdir(metrics_dir))
        os.kill(victim, signal.SIGKILL)
        now: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (len(now) == 2 and victim not in now):
            time.sleep(0.2)
            now = _workers(procs[-1].pid)
        assert len(now) == 2 and victim not in now, now
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'kvpath_proxy_requests_total{endpoint="/v1/completions",status="200"} 8.0' in text.splitlines()
        assert not [f for f in os.listdir(metrics_dir) if f.startswith("gauge_live") and f.endswith(f"_{victim}.db")]
    finally:
        terminate(procs, 20)
        p.stop()
        d.stop()


def test_a_dead_workers_live_gauges_leave_the_sums(tmp_path, monkeypatch):
    """A worker killed without stopping leaves its in-flight gauge's file; a scrape drops
    it (its pid is gone), keeps a live process's, and leaves counters alone."""
    from kvpath.proxy.metrics import _forget_dead_workers

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    dead = 2 ** 31 - 7  # above any pid the kernel gives (pid_max is at most 2^22)
    for name in (f"gauge_livesum_{dead}.db", f"gauge_livesum_{os.getpid()}.db", f"counter_{dead}.db"):
        (tmp_path / name).write_bytes(b"")
    _forget_dead_workers()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"gauge_livesum_{os.getpid()}.db",
                                                                  f"counter_{dead}.db"])


def test_an_update_of_an_instance_is_made_in_place():
    """Requests in flight hold the instance they were routed to and end on it: an update
    (the same URL again) changes that object's fields, so its in-flight count still
    returns to zero."""
    pool = InstancePool("prefill")
    first = Instance("http://p0", "prefill", "l0h0", "127.0.0.1:1", tp_size=2)
    assert pool.add(first)
    first.inflight = 3
    assert not pool.add(Instance("http://p0", "prefill", "l0h1", "127.0.0.1:2", engine_id="e"))
    assert pool.get("http://p0") is first and first.inflight == 3
    assert (first.fabric_host, first.kv_addr, first.engine_id, first.tp_size) == ("l0h1", "127.0.0.1:2", "e", 0)
