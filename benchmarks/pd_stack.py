"""P and D ``vllm serve`` with KVPathConnector behind ``kvpath proxy --mode push`` and a
``cc`` reservation service, on this machine's loopback, for the P/D benchmarks
(``pd_minimum.py``, ``pd_tp_load.py``). Each engine's whole process tree is bound to its
cores (``VLLMServer.pin_all``), both started by ``kvpath.testbed.pd_pair``."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpath.credentials import write_secret_file
from kvpath.reservation.wire import TOKEN_ENV as RES_TOKEN_ENV
from kvpath.testbed.readiness import wait_http
from kvpath.testbed.pd_pair import PDSide, pd_pair
from kvpath.testbed.vllm_server import VLLMServer

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
        self.model, self.work, self.lanes, self.pin_all = model, work, lanes, pin_all
        self.keys = work / "keys"
        self.api_key = secrets.token_urlsafe(24)
        self.key_file = write_secret_file(self.keys / "engine-api-key", self.api_key)
        self.res_token = secrets.token_urlsafe(24)
        res_token_file = write_secret_file(self.keys / "res-token", self.res_token)
        self.p_side = PDSide(P_PORT, P_SIDE, tp=p_tp, trace=True, knobs={
            "reservation_url": f"http://127.0.0.1:{RES_PORT}", "fabric_host": "l0h0", "engine_id": "p-engine",
            "reservation_token_file": str(res_token_file), **(p_knobs or {})})
        self.d_side = PDSide(D_PORT, D_SIDE, trace=True,
                             knobs={"fabric_host": "l1h0", "engine_id": "d-engine", **(d_knobs or {})})
        self.p: VLLMServer  # both set by entering
        self.d: VLLMServer
        self.procs: list[subprocess.Popen] = []
        self.proxy = f"http://127.0.0.1:{PROXY_PORT}"
        self._engines = contextlib.ExitStack()

    def _kvpath(self, args: list[str], log: str) -> subprocess.Popen:
        env = {**os.environ, RES_TOKEN_ENV: self.res_token}
        with open(self.work / log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "kvpath.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def __enter__(self) -> "Stack":
        try:
            self._kvpath(["reservation", "--port", str(RES_PORT), "--mode", "cc"], "reservation.log")
            pair = self._engines.enter_context(pd_pair(
                self.model, self.work, self.p_side, self.d_side, knobs={"ucx_net_devices": "lo", "lanes": self.lanes},
                keys_dir=self.keys, api_key=self.api_key, pin_all=self.pin_all, stop_signal=signal.SIGTERM))
            self.p, self.d = pair.p, pair.d
            px = self._kvpath([
                "proxy", "--mode", "push", "--port", str(PROXY_PORT),
                "--prefill", f"{self.p.url},kv_addr=127.0.0.1:{P_SIDE},fabric_host=l0h0,engine_id=p-engine",
                "--decode", f"{self.d.url},fabric_host=l1h0,engine_id=d-engine",
                "--reservation-url", f"http://127.0.0.1:{RES_PORT}",
                "--engine-api-key-file", str(self.key_file)], "proxy.log")
            wait_http(self.proxy + "/health", px, 60.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with self._engines:  # P and D last, also when a process does not end
            for p in self.procs:
                p.terminate()
            for p in self.procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
