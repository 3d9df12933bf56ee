"""Several proxy processes in front of one reservation service: the decisions stay one
set, so admissions through different proxies at the same moment never take the same
free link twice (decisions, not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvpath.deployment import KV_SIDE_CHANNEL_PORT
from kvpath.fabric import FabricSpec
from kvpath.reservation import wire
from kvpath.testbed.readiness import free_port, terminate, wait_http
from kvpath.testbed.stub_engine import ServerThread, StubBehaviour, create_stub_app

FABRIC = {"leaves": 2, "spines": 4, "hosts_per_leaf": 2}
TOKEN = "r3s-t0ken-tier"


def _lanes_on_every_spine(spec: FabricSpec, src: str, dst: str) -> list[dict]:
    """One lane per spine (source ports the fabric's hash puts on each), as P registers them."""
    out, port = {}, 41000
    while len(out) < spec.spines:
        sp = spec.flow_path(src, dst, port, KV_SIDE_CHANNEL_PORT).spine
        out.setdefault(sp, {"lane": len(out), "src_port": port, "dst_port": KV_SIDE_CHANNEL_PORT})
        port += 1
    return list(out.values())


def start_service(tmp_path, env: dict) -> tuple[subprocess.Popen, str, str]:
    """A `kvpath reservation` process (cc) on FABRIC with one lane on each spine registered
    for l0h0 -> l1h0: (its process, its URL, the fabric file). The caller ends it."""
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(FABRIC))
    res_url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "kvpath.cli", "reservation", "--port", res_url.rsplit(":", 1)[1],
                             "--fabric", str(fabric), "--mode", "cc", "--lease-s", "60"], env=env)
    try:
        wait_http(res_url + "/health", proc, timeout_s=60)
        r = httpx.post(res_url + wire.LANES_PATH, headers={"Authorization": f"Bearer {env[wire.TOKEN_ENV]}"}, json={
            "src_host": "l0h0", "dst_host": "l1h0",
            "lanes": _lanes_on_every_spine(FabricSpec(**FABRIC), "l0h0", "l1h0")})
        assert r.status_code == 200, r.text
    except BaseException:
        proc.kill()
        raise
    return proc, res_url, str(fabric)


def test_two_proxy_processes_share_one_reservation_service_and_never_stack_a_free_spine(tmp_path):
    """Two `kvpath proxy` processes, each with its own P/D legs, reserve in one `kvpath
    reservation` process: four requests at once, two through each, take the four spines
    of the pair's four lanes, one each. (Each proxy deciding alone would put its own two
    on the same two lowest-loaded spines as the other: two spines twice.)"""
    env = {**os.environ, wire.TOKEN_ENV: TOKEN}
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    # P answers after 1 s: the four reservations are all live when the last is decided
    p = ServerThread(create_stub_app("P0", StubBehaviour(delay_s=1.0)), free_port()).start()
    d = ServerThread(create_stub_app("D0", StubBehaviour()), free_port()).start()
    service, res_url, fabric = start_service(tmp_path, env)
    procs = [service]
    try:
        urls = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvpath.cli", "proxy", "--mode", "push", "--port", str(port),
                 "--policy", "least_outstanding", "--fabric", str(fabric),
                 "--prefill", f"{p.url},kv_addr=127.0.0.1:{KV_SIDE_CHANNEL_PORT},fabric_host=l0h0",
                 "--decode", f"{d.url},fabric_host=l1h0", "--reservation-url", res_url,
                 "--reservation-timeout-s", "10"], env=env))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health", procs[-1], timeout_s=60)
        body = {"model": "tiny", "prompt": "spine leaf lane path push pull", "max_tokens": 4}
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(lambda k: httpx.post(urls[k % 2] + "/v1/completions", json=body, timeout=60),
                                  range(4)))
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        log = httpx.get(res_url + wire.DECISIONS_PATH, headers=hdr, timeout=10).json()["decisions"]
        assert len(log) == 4
        assert sorted(x["spine"] for x in log) == [f"spine{i}" for i in range(4)]  # one each: never stacked
    finally:
        terminate(procs, 15)
        p.stop()
        d.stop()
