"""How the testbed starts a vLLM engine: in a process group of its own (stopped as one),
in a session of its own by default (a kernel autogroup: its spinning threads take only
that group's share from the processes beside it) or, with ``own_session=False``, in the
launcher's session: at TP > 1 an EngineCore spinning on sched_yield in a group of its own
kept a core from the other engines for minutes (docs/connector-tp.md, "CPU 0 stalls")."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from kvpath.testbed.pd_pair import PDSide, side_server
from kvpath.testbed.vllm_server import VLLMServer, own_session_for


class _Sleeper(VLLMServer):
    """The launcher with a child that forks a grandchild and sleeps, in place of vllm serve."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import os, time; os.fork(); time.sleep(60)"]


@pytest.mark.parametrize("own_session", [True, False])
def test_an_engine_gets_its_own_process_group_and_the_session_asked_for(tmp_path, own_session):
    s = _Sleeper(model="unused", port=1, log_path=str(tmp_path / "log"), own_session=own_session).start()
    try:
        pid = s.proc.pid
        deadline = time.monotonic() + 10
        while len(_group(pid)) < 2 and time.monotonic() < deadline:  # the child has forked
            time.sleep(0.05)
        assert len(_group(pid)) == 2
        assert os.getpgid(pid) == pid  # a group of its own: kill() reaches every process of it
        assert (os.getsid(pid) == pid) == own_session and (os.getsid(pid) == os.getsid(0)) != own_session
    finally:
        s.stop()
    assert s.proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while (left := _group(pid)) and time.monotonic() < deadline:  # the signal takes a moment
        time.sleep(0.05)
    assert left == []  # the forked child went with the group


def test_engines_of_a_deployment_at_tp_above_1_share_the_launchers_session(tmp_path):
    assert own_session_for((1, 1)) and not own_session_for((2, 1)) and not own_session_for((1, 2))
    side = PDSide(8100, 5800, tp=2)
    for own in (True, False):
        srv = side_server("/m", "kv_producer", side, 0, tmp_path / "p.log", keys_dir=tmp_path / "keys",
                          own_session=own)
        assert srv.own_session == own


def _group(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (zombies left out), from /proc."""
    live = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            live.append(int(d))
    return live
