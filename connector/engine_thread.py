"""What the writer (P) and receiver (D) threads share: identity, queues, wake-ups.

The engine loop hands work over through a queue and wakes the thread with a byte
on an inproc ZMQ pair, so the thread can sleep in ``zmq.poll`` while idle (no busy
polling) and still react at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import zmq

from kvpath.connector import messages as M
from kvpath.connector.config import KVPathConfig
from kvpath.connector.kv_dump import KVDump
from kvpath.connector.kv_verify import Verifier
from kvpath.connector.nixl_io import PROBE_BYTES, register
from kvpath.connector.stall_watch import StallWatch
from kvpath.connector.telemetry import Stats
from kvpath.trace import ReceivedRecord, TraceWriter, TransferRecord

logger = logging.getLogger(__name__)

# How long a thread with nothing held sleeps between ticks. Engine commands and control
# messages wake the poll at once, and with nothing held no deadline can fall due; what
# does not wake it (NIXL notifications, UCX traffic such as a WRITE's completion or a
# lane probe) only happens while something is held or just after: the threads keep the
# idle pace for LINGER_S after the last held item before they go dormant. This keeps
# an idle engine's connector threads far under 1% of a core.
DORMANT_POLL_MS = 250
LINGER_S = 1.0


def _release_zmq(sockets: list[zmq.Socket], ctx: zmq.Context) -> None:
    for s in sockets:
        s.close(0)
    ctx.destroy(linger=0)


class EngineThread:
    STOP_TIMEOUT_S = 10.0  # close() waits this long for the thread (a lane probe takes up to 5 s)
    CTX_MAX_SOCKETS: int | None = None  # the ZMQ context's socket budget (None: libzmq's 1023)
    kv_dump: KVDump | None = None  # the kv_dump_dir knob's writer, when set
    kv_verify: Verifier | None = None  # the kv_verify knob's hashing, when on

    def __init__(
        self,
        cfg: KVPathConfig,
        layout: M.BlockLayout,
        spans: list[tuple[int, int]],
        engine_id: str | None,
        rank: int,
        stats: Stats | None,
        trace: TraceWriter | None,
        id_prefix: str,
        compat: M.Compat | None = None,
    ):
        self.cfg = cfg
        self.layout = layout
        self.spans = spans
        self.engine_id = engine_id or cfg.engine_id or f"{id_prefix}-{uuid.uuid4().hex[:8]}"
        self.rank = rank
        self.stats = stats or Stats()
        self.trace = trace or TraceWriter(cfg.trace_path, max_bytes=cfg.trace_max_bytes, keep=cfg.trace_keep)
        # Without vLLM (tests, benchmarks) only the layout is known.
        self.compat = compat or M.Compat(block_size=layout.block_size, kv_layout=layout.shape(), tp_rank=rank)
        self.kv_dump = KVDump(cfg.kv_dump_dir, id_prefix, rank) if cfg.kv_dump_dir else None
        self.kv_verify = Verifier.make(cfg.kv_verify, layout, spans, id_prefix)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # the running step's start (StallWatch reads it)
        # a context of its own, closed with the thread; sized by the subclass where its
        # sockets can outnumber libzmq's default (1023)
        self._ctx = zmq.Context()
        if self.CTX_MAX_SOCKETS is not None:
            self._ctx.set(zmq.MAX_SOCKETS, self.CTX_MAX_SOCKETS)
        # A small registered buffer: D's is the target of lane-opening probes, P's the source.
        self.probe = np.zeros(PROBE_BYTES, dtype=np.uint8)
        self._wake_lock = threading.Lock()
        addr = f"inproc://kvpath-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(addr)
        self._sockets: list[zmq.Socket] = [self._wake_rx, self._wake_tx]
        # A thread never closed (a start that raised, a test that failed half-way) is freed
        # by the cycle collector (its parts hold callbacks into it). Its sockets must close
        # before its context goes, or the context's term blocks the process: the finalizer
        # holds them, so they are not part of that garbage. Not at exit: the thread may run.
        self._finalizer = weakref.finalize(self, _release_zmq, self._sockets, self._ctx)
        self._finalizer.atexit = False
        self._nixl_regs: list[tuple[Any, Any]] = []  # (agent, registration): deregistered on close
        # set when a result for the engine is ready (a push ended, a receive released);
        # the worker may share one event between its writer and receiver
        self.results_ready = threading.Event()

    def _register(self, agent: Any, spans: list[tuple[int, int]], mem_type: str, device_id: int = 0) -> None:
        self._nixl_regs.append((agent, register(agent, spans, mem_type, device_id)))

    def record(self, rec: Any) -> None:
        """Append a record to the connector's log. Never raises: a record that cannot be
        written (disk full, a value the schema refuses) must not skip the release, ack or
        cleanup that follows it on the engine thread."""
        try:
            if isinstance(rec, TransferRecord):
                rec.rank = self.rank
                if not rec.peer_engine:
                    # no D worker behind it (expired, cancelled): the rank equal TP sizes pair it with
                    rec.peer_rank = self.rank
            elif isinstance(rec, ReceivedRecord):
                rec.rank = self.rank  # D's rank: one receipt per flow at TP > 1
            self.trace.write(rec)
        except Exception:
            self.stats.inc("trace_write_failed")
            logger.exception("%s: a trace record could not be written", type(rec).__name__)

    @property
    def native_id(self) -> int | None:
        """The engine thread's OS id (for per-thread CPU accounting), None before start."""
        return self._thread.native_id if self._thread is not None else None

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()
        StallWatch.shared().add(self)  # here, not in the thread: the watcher is up when start() returns

    def _loop(self, step: Callable[[], None]) -> None:
        """Run ``step`` until closed. An unexpected exception is logged and counted and
        the loop goes on: the requests it touched end by their own deadlines, and the
        engine keeps serving the others (a dead thread would hang them all)."""
        while not self._stop.is_set():
            self._step_started = time.monotonic()
            try:
                step()
            except Exception:
                self.stats.inc("engine_thread_errors")
                logger.exception("%s: unexpected error (loop continues)", threading.current_thread().name)
                time.sleep(0.01)  # a persistent fault must not spin a core
        self._step_started = None

    # what the process's StallWatch reads
    def step_started_at(self) -> float | None:
        return self._step_started if self.alive() else None

    def thread_ident(self) -> int | None:
        return self._thread.ident if self._thread is not None else None

    def thread_name(self) -> str:
        return self._thread.name if self._thread is not None else "kvpath engine thread"

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll_events(self, timeout_ms: int) -> dict | None:
        """Wait up to ``timeout_ms`` for socket events (a wake-up is consumed here);
        None when the sockets were closed under us: the thread then stops."""
        try:
            events = dict(self._poller.poll(timeout_ms))
        except zmq.ZMQError:
            self._stop.set()
            return None
        if self._wake_rx in events:
            self._drain_wake()
        return events

    def put(self, kind: str, arg: Any) -> None:
        """Called from the engine thread: queue work and wake the engine thread."""
        self._cmds.put((kind, arg))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _drain_wake(self) -> None:
        while self._wake_rx.poll(0):
            self._wake_rx.recv()

    def _commands(self) -> Iterator[tuple[str, Any]]:
        while True:
            try:
                yield self._cmds.get_nowait()
            except queue.Empty:
                return

    @property
    def closed(self) -> bool:
        """close() released the thread's sockets (its ZMQ context is gone)."""
        return self._ctx.closed

    def close(self) -> bool:
        """Stop the thread, then close its sockets and release its NIXL agents. False
        when the thread did not stop in time (stuck in a NIXL call): its sockets and
        agents are then left to the process's exit, never pulled from under it."""
        self._stop.set()
        self._wake()
        if self._thread:
            self._thread.join(timeout=self.STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("%s did not stop in %g s: its sockets and NIXL agents stay until the process exits",
                               self._thread.name, self.STOP_TIMEOUT_S)
                self.trace.close()
                return False
        # the finalizer's own release, run now (once): every socket, then the context
        # (any socket left, a link made as an error struck, too). Under the wake lock: other
        # threads (a host name's lookup) may be waking us through one of those sockets.
        with self._wake_lock:
            self._finalizer()
        # transfers and remote agents first, then the memory they point at
        try:
            self._drop_agents()
        except Exception:
            logger.warning("releasing the NIXL agents failed", exc_info=True)
        for agent, reg in self._nixl_regs:
            try:
                agent.deregister_memory(reg)
            except Exception:
                logger.debug("deregistering memory failed", exc_info=True)
        self._nixl_regs.clear()
        self.trace.close()
        return True

    def _drop_agents(self) -> None:
        """Release the NIXL agents (their remote agents first): the subclass knows them."""
