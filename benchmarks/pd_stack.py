"""P and D ``vllm serve`` with KVPathConnector behind ``kvpath proxy --mode push`` and a
``cc`` reservation service, on this machine's loopback, for the P/D benchmarks
(``pd_minimum.py``, ``pd_tp_load.py``). Each engine's whole process tree is bound to its
cores (``VLLMServer.pin_all``)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpath.credentials import write_secret_file
from kvpath.reservation.wire import TOKEN_ENV as RES_TOKEN_ENV
from kvpath.testbed.readiness import wait_http
from kvpath.testbed.vllm_server import VLLMServer, connector_config

P_PORT, D_PORT, PROXY_PORT, RES_PORT, P_SIDE, D_SIDE = 8310, 8320, 8330, 8340, 5930, 5940


async def stream_ttft(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int,
                      headers: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(TTFT s, total s, the request id the server named) of one streamed completion."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, rid = None, ""
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error'].get('message')}")
            rid = rid or chunk.get("id", "")
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{url}: the stream had no token")
    return ttft, time.perf_counter() - t0, rid


class Stack:
    """P, D, the reservation service and the proxy, on this machine's loopback."""

    def __init__(self, model: str, work: Path, lanes: int, p_knobs: dict | None = None,
                 d_knobs: dict | None = None, pin_all: bool = True, p_tp: int = 1) -> None:
        """``p_tp`` 2: P's two ranks on cores 0 and 1, D on core 1."""
        self.work = work
        keys = work / "keys"
        self.api_key = secrets.token_urlsafe(24)
        self.key_file = write_secret_file(keys / "engine-api-key", self.api_key)
        self.res_token = secrets.token_urlsafe(24)
        res = f"http://127.0.0.1:{RES_PORT}"
        common = dict(keys_dir=keys, ucx_net_devices="lo", lanes=lanes)
        pk = connector_config("kv_producer", P_SIDE, reservation_url=res, fabric_host="l0h0", engine_id="p-engine",
                              trace_path=str(work / "p_trace.jsonl"),
                              reservation_token_file=str(write_secret_file(keys / "res-token", self.res_token)),
                              **common, **(p_knobs or {}))
        dk = connector_config("kv_consumer", D_SIDE, fabric_host="l1h0", engine_id="d-engine",
                              trace_path=str(work / "d_trace.jsonl"), **common, **(d_knobs or {}))
        p_tp_args = dict(cpu=None, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                         extra_args=["--tensor-parallel-size", "2"]) if p_tp == 2 else dict(cpu=0)
        self.p = VLLMServer(model, P_PORT, kv_transfer_config=pk, log_path=str(work / "p.log"),
                            api_key=self.api_key, pin_all=pin_all, **p_tp_args)
        self.d = VLLMServer(model, D_PORT, cpu=1, kv_transfer_config=dk, log_path=str(work / "d.log"),
                            api_key=self.api_key, pin_all=pin_all)
        self.procs: list[subprocess.Popen] = []
        self.proxy = f"http://127.0.0.1:{PROXY_PORT}"

    def _kvpath(self, args: list[str], log: str) -> subprocess.Popen:
        env = {**os.environ, RES_TOKEN_ENV: self.res_token}
        with open(self.work / log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "kvpath.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def __enter__(self) -> "Stack":
        self.p.start()
        self.d.start()
        self._kvpath(["reservation", "--port", str(RES_PORT), "--mode", "cc"], "reservation.log")
        self.p.wait_ready()
        self.d.wait_ready()
        px = self._kvpath(["proxy", "--mode", "push", "--port", str(PROXY_PORT),
                           "--prefill", f"{self.p.url},kv_addr=127.0.0.1:{P_SIDE},fabric_host=l0h0,engine_id=p-engine",
                           "--decode", f"{self.d.url},fabric_host=l1h0,engine_id=d-engine",
                           "--reservation-url", f"http://127.0.0.1:{RES_PORT}",
                           "--engine-api-key-file", str(self.key_file)], "proxy.log")
        wait_http(self.proxy + "/health", px, 60.0)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.p.stop()
        self.d.stop()
