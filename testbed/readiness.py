"""Local servers coming up and going down: free ports, HTTP readiness polls (tests,
benchmarks and the vLLM launcher), and the testbed's server processes with their logs."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0, interval_s: float = 0.3,
              require_200: bool = False, hint: str = "", request_timeout_s: float = 1.0) -> None:
    """Poll ``url`` until it answers (with 200 if ``require_200``). A ``proc`` that
    exits first is a RuntimeError; no answer by ``timeout_s`` a TimeoutError.
    ``hint`` (where to look, e.g. a log path) ends both messages."""
    tail = f"; {hint}" if hint else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}{tail}")
        if answers(url, require_200, request_timeout_s):
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{url}: no answer after {timeout_s:.0f}s{tail}")


def answers(url: str, require_200: bool = False, request_timeout_s: float = 1.0) -> bool:
    """One look: ``url`` answers (with 200 if ``require_200``)."""
    try:
        r = httpx.get(url, timeout=request_timeout_s)
    except httpx.HTTPError:
        return False
    return not require_200 or r.status_code == 200


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """A testbed server process in its own session (so a run's end stops its children),
    stdout and stderr in ``log``, UCX on TCP."""
    env = dict(os.environ, UCX_TLS="tcp", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def terminate(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL those that outlive ``grace_s`` each."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
