"""A prefill and a decode ``vllm serve`` on this machine's loopback, started as one:
the P+D start of the e2e tests, the benchmarks and ``kvpath connector demo``.

:func:`pd_pair` builds both :class:`~kvpath.testbed.vllm_server.VLLMServer` (KVPathConnector
with the control channel's keys, or a whole baseline ``--kv-transfer-config``), binds each
to its own cores, starts both, waits until both answer ``/health``, and always stops both:
on leaving, and when either fails to come up (then a :class:`EngineStartError` names the
side and shows the end of its log). :func:`serving` does the same for any named servers
(one engine that joins a pair, or a single baseline engine). The testbed's per-host
engines (:mod:`kvpath.testbed.vllm_engines`) keep their own loop over ``VLLMServer``."""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from kvpath.testbed.readiness import answers
from kvpath.testbed.vllm_server import VLLMServer, connector_config, cpus_for, own_session_for, rank_cores

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 30  # how much of a failed engine's log its error shows


@dataclass
class PDSide:
    """What one side of a pair has of its own (the pair's shared settings are
    :func:`pd_pair`'s arguments)."""

    port: int  # the API server's
    side_channel_port: int | None = None  # KVPathConnector's control channel (not with kv_transfer_config)
    tp: int = 1  # --tensor-parallel-size
    # one core per TP rank (rank r's OpenMP threads on cores[r]); None: the side's own
    # core (the first or second this process may use, for P and D) and on (rank_cores)
    cores: Sequence[int] | None = None
    knobs: Mapping[str, Any] = field(default_factory=dict)  # kv_connector_extra_config of this side only
    trace: bool = False  # the connector's trace in the logs folder (p_trace.jsonl, d_trace.jsonl)
    env: Mapping[str, str] = field(default_factory=dict)  # for the engine's processes, last (wins)
    extra_args: Sequence[str] = ()  # more `vllm serve` arguments
    # a whole --kv-transfer-config instead of KVPathConnector's (an in-tree baseline connector)
    kv_transfer_config: dict[str, Any] | None = None


@dataclass
class PDPair:
    """A started pair: the two servers, where their keys, logs and traces are."""

    p: VLLMServer
    d: VLLMServer
    keys_dir: Path
    p_log: Path
    d_log: Path
    p_trace: Path | None  # None: the side writes none
    d_trace: Path | None
    p_side_channel_port: int | None  # None: a side with a whole kv_transfer_config

    @property
    def p_url(self) -> str:
        return self.p.url

    @property
    def d_url(self) -> str:
        return self.d.url

    @property
    def kv_addr(self) -> str:
        """P's control channel, host:port: what a D leg names as its peer."""
        return f"{self.p.host}:{self.p_side_channel_port}"


class EngineStartError(RuntimeError):
    """An engine of a pair (or of :func:`serving`) that did not come up: which one, why,
    and the end of its log."""

    def __init__(self, name: str, server: VLLMServer, why: str):
        self.name, self.server = name, server
        super().__init__(f"{name} (vllm serve on port {server.port}) did not come up: {why}\n"
                         + log_tail(server.log_path))


def log_tail(path: str | Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of an engine's log, headed by its path."""
    if not path:
        return "(its output went nowhere: no log_path)"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(its log {path} could not be read: {e})"
    return f"--- the last {lines} lines of {path} ---\n" + "\n".join(text.splitlines()[-lines:])


def side_server(model: str | Path, role: str, side: PDSide, home: int | None, log_path: Path, *,
                keys_dir: Path, knobs: Mapping[str, Any] | None = None, trace_path: Path | None = None,
                api_key: str | None = None, pin_all: bool = True, own_session: bool = True) -> VLLMServer:
    """One side's server, not started. ``role``: kv_producer or kv_consumer; ``home``: its
    own core when ``side.cores`` does not name them; ``own_session``: VLLMServer's."""
    if side.kv_transfer_config is not None:
        if side.knobs or side.trace or side.side_channel_port is not None:
            raise ValueError("a side with a whole kv_transfer_config takes no knobs, trace or side_channel_port")
        ktc = side.kv_transfer_config
    else:
        if side.side_channel_port is None:
            raise ValueError(f"the {role} side needs a side_channel_port (or a whole kv_transfer_config)")
        extra = {**(knobs or {}), **side.knobs}
        if trace_path is not None:
            extra["trace_path"] = str(trace_path)
        ktc = connector_config(role, side.side_channel_port, keys_dir=keys_dir, **extra)
    cores = list(side.cores) if side.cores is not None else rank_cores(home, side.tp) if home is not None else None
    if cores is not None and len(cores) != side.tp:
        raise ValueError(f"the {role} side at TP={side.tp} names {len(cores)} cores: one per rank, please")
    env: dict[str, str] = {}
    args: list[str] = []
    cpu = None
    if side.tp > 1:
        args = ["--tensor-parallel-size", str(side.tp)]
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores)
    elif cores is not None:
        cpu = cores[0]
    return VLLMServer(str(model), side.port, cpu=cpu, kv_transfer_config=ktc, log_path=str(log_path),
                      env={**env, **side.env}, extra_args=[*args, *side.extra_args], api_key=api_key,
                      pin_all=pin_all, own_session=own_session)


@contextmanager
def pd_pair(model: str | Path, logs: str | Path, p: PDSide, d: PDSide, *, knobs: Mapping[str, Any] | None = None,
            keys_dir: str | Path | None = None, api_key: str | None = None, pin_all: bool = True,
            stop_signal: int = signal.SIGKILL, ready_timeout_s: float = 300.0) -> Iterator[PDPair]:
    """P (kv_producer) and D (kv_consumer) serving ``model``, both ready; both stopped
    on leaving (``stop_signal`` to each process group: SIGKILL, or SIGTERM for a clean
    stop, SIGKILL after 30 s), also when either fails to come up (EngineStartError).

    ``logs``: the folder of p.log and d.log (and the traces a side asks for);
    ``knobs``: kv_connector_extra_config of both sides (a side's own win); ``keys_dir``:
    the control channel's keys (made there on first use; default ``logs/keys``);
    ``api_key``: vLLM's API key of both; ``pin_all``: each engine's whole process tree
    on its cores (VLLMServer.pin_all). P's own core is the first this process may use,
    D's the second (``cpus_for``), unless a side names its cores."""
    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    keys = Path(keys_dir) if keys_dir is not None else logs / "keys"
    homes = cpus_for(2) if p.cores is None or d.cores is None else [None, None]
    servers, paths = {}, []
    for name, role, side, home in (("P", "kv_producer", p, homes[0]), ("D", "kv_consumer", d, homes[1])):
        tag = name.lower()
        log, trace = logs / f"{tag}.log", logs / f"{tag}_trace.jsonl" if side.trace else None
        servers[name] = side_server(model, role, side, home, log, keys_dir=keys, knobs=knobs, trace_path=trace,
                                    api_key=api_key, pin_all=pin_all, own_session=own_session_for((p.tp, d.tp)))
        paths.append((log, trace))
    (p_log, p_trace), (d_log, d_trace) = paths
    with serving(servers, stop_signal=stop_signal, ready_timeout_s=ready_timeout_s):
        yield PDPair(servers["P"], servers["D"], keys, p_log, d_log, p_trace, d_trace, p.side_channel_port)


@contextmanager
def serving(servers: Mapping[str, VLLMServer], *, stop_signal: int = signal.SIGKILL,
            ready_timeout_s: float = 300.0) -> Iterator[Mapping[str, VLLMServer]]:
    """``servers`` (by the names an error gives them) started and ready; every one
    stopped on leaving (``stop_signal``), also when one fails to start or come up."""
    done = False
    try:
        for name, server in servers.items():
            try:
                server.start()
            except OSError as e:  # no vllm command, no log folder
                raise EngineStartError(name, server, f"{type(e).__name__}: {e}") from e
        wait_all_ready(servers, ready_timeout_s)
        yield servers
        done = True
    finally:  # an error of the stop does not hide the one that ended the block
        stop_all(servers.values(), stop_signal, raise_errors=done)


def wait_all_ready(servers: Mapping[str, VLLMServer], timeout_s: float = 300.0, interval_s: float = 1.0) -> None:
    """Until every server's /health answers 200. A server whose process exits first, or
    one that has not answered by ``timeout_s``, is an EngineStartError at once (whatever
    the others do)."""
    pending = dict(servers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for name, server in list(pending.items()):
            if server.proc is None or server.proc.poll() is not None:
                code = None if server.proc is None else server.proc.returncode
                raise EngineStartError(name, server, f"its process exited with {code}")
            if answers(f"{server.url}/health", require_200=True, request_timeout_s=2.0):  # as wait_ready asks
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            name, server = next(iter(pending.items()))
            raise EngineStartError(name, server, f"/health did not answer 200 in {timeout_s:.0f}s")
        time.sleep(interval_s)


def stop_all(servers: Iterable[VLLMServer], stop_signal: int = signal.SIGKILL, raise_errors: bool = True) -> None:
    """``stop_signal`` to each server's process group (see VLLMServer.kill); every one
    is tried, the first error raised after (or only logged)."""
    first: Exception | None = None
    for server in servers:
        try:
            server.kill(stop_signal)
        except Exception as e:  # e.g. a process group that outlived SIGKILL's wait
            logger.warning("vllm serve on port %s did not stop: %r", server.port, e)
            first = first or e
    if first is not None and raise_errors:
        raise first
