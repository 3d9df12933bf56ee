"""benchmarks/bench_tp_fanout.py's TP workers: the operations the coordinator fans out, and
the worker processes that ack them from kvpath's engine thread, fed by vLLM's MessageQueue
(vllm-mq) or on a ZMQ ROUTER of their own (the direct channels) (a module the script
imports, not a script)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvpath.connector.config import KVPathConfig
from kvpath.connector.engine_thread import DORMANT_POLL_MS, EngineThread
from kvpath.connector.messages import BlockLayout
from kvpath.connector.step_commands import RecvReq, SendReq, StepCommands

logger = logging.getLogger("bench_tp_fanout")  # the script's: one name in its log

OP_TIMEOUT_S, SETUP_TIMEOUT_S, STOP_TIMEOUT_S = 10.0, 30.0, 5.0  # generous: TP 8 on 2 cores is oversubscribed
# vLLM sizes its ring with VLLM_MQ_MAX_CHUNK_BYTES_MB (16 MiB) x 10 chunks; a small
# message takes the same path in a 1 MiB chunk, and /dev/shm stays small at TP 8.
CHUNK_BYTES, MAX_CHUNKS = 1 << 20, 10
Ack = tuple[int, int, float]  # (operation's seq, rank, the worker's process time for a "cpu" op)


@dataclass
class Op:
    seq: int
    kind: str  # one of the script's OPERATIONS, or "cpu" (the ack carries the worker's process time)
    meta: StepCommands | None = None


def make_op(seq: int, kind: str, rng: random.Random) -> Op:
    """As big as the real thing: ids as vLLM and kvpath make them, 64 scattered blocks."""
    rid, tid = f"cmpl-{rng.getrandbits(128):032x}-0", f"{rng.getrandbits(128):032x}"
    key = f"{rng.getrandbits(256):064x}"
    blocks = sorted(rng.sample(range(20000), 64))
    if kind == "registration":
        return Op(seq, kind, StepCommands(registrations=[RecvReq(rid, tid, "10.0.0.2:5600", blocks, 0, transfer_key=key)]))
    lease = f"lease-{rng.getrandbits(64):016x}"
    return Op(seq, kind, StepCommands(finished=[SendReq(rid, tid, blocks, rng.randrange(4), lease, transfer_key=key)]))


def ack(op: Op, rank: int) -> Ack:
    return op.seq, rank, time.process_time() if op.kind == "cpu" else 0.0


# ---------------------------------------------------------------- worker processes

class AckThread(EngineThread):
    """kvpath's engine thread with only its hand-over: an operation comes by ``put``
    (queue + wake: vllm-mq) or on its ROUTER (direct channels) and is acked at once."""

    def __init__(self, rank: int, router: zmq.Socket | None, resp: Any):
        layout = BlockLayout(regions=[], num_blocks=1, block_size=16)
        super().__init__(KVPathConfig(), layout, [], "fanout", rank, None, None, "fanout")
        self._router, self._resp = router, resp
        self._poller = zmq.Poller()
        for s in (self._wake_rx, router):
            if s is not None:
                self._poller.register(s, zmq.POLLIN)
        if router is not None:
            self._sockets.append(router)
        self._start_thread(lambda: self._loop(self._step), f"fanout-ack-{rank}")

    def _step(self) -> None:
        events = self.poll_events(DORMANT_POLL_MS)
        for _, op in self._commands():
            self._resp.enqueue(ack(op, self.rank))
        while events and self._router in events and self._router.poll(0):
            ident, payload = self._router.recv_multipart()
            self._router.send_multipart([ident, pickle.dumps(ack(pickle.loads(payload), self.rank))])


def worker_main(rank: int, mode: str, conn: Connection, inherited: list[Connection], addr: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the coordinator stops us
    for c in inherited:  # the coordinator's pipe ends: closed here, so its death reads as EOF
        c.close()
    if mode != "vllm-mq":
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.bind(addr)
        thread = AckThread(rank, router, None)
        conn.send("ready")
        try:
            conn.recv()  # "stop", or EOF: the coordinator is gone
        except (EOFError, OSError):
            pass
        thread.close()
        return
    from vllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue

    handle = conn.recv()
    if not isinstance(handle, Handle):  # "stop" before set-up
        return
    done = threading.Event()
    cmd = MessageQueue.create_from_handle(handle, rank)

    def watchdog() -> None:  # as vLLM's death-pipe monitor: "stop" or EOF cancels the blocked dequeue
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        cmd.shutdown()
        if not done.wait(STOP_TIMEOUT_S):
            os._exit(1)  # still in set-up: wait_until_ready cannot be cancelled

    threading.Thread(target=watchdog, daemon=True).start()
    resp = MessageQueue(1, 1, max_chunk_bytes=CHUNK_BYTES, max_chunks=MAX_CHUNKS)  # as vLLM's WorkerProc
    conn.send(resp.export_handle())
    cmd.wait_until_ready()
    resp.wait_until_ready()
    thread = AckThread(rank, None, resp)
    try:
        while True:
            thread.put("op", cmd.dequeue(indefinite=True))  # what KVPathWorker.process_metadata does
    except RuntimeError:  # cancelled
        pass
    finally:
        thread.close()
        del thread, resp  # this worker created its response ring: its __del__ unlinks it
        done.set()


@dataclass
class Workers:
    procs: list[mp.Process] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    addrs: list[str] = field(default_factory=list)

    def recv(self, rank: int) -> Any:
        if not self.conns[rank].poll(SETUP_TIMEOUT_S):
            raise TimeoutError(f"worker {rank} did not answer in {SETUP_TIMEOUT_S:g} s")
        return self.conns[rank].recv()

    def stop(self) -> None:
        """Ask every worker to stop, wait, then terminate, then kill: none is left behind."""
        for c in self.conns:
            try:
                c.send("stop")
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            for end in (p.terminate, p.kill):
                if p.is_alive():
                    logger.warning("worker %s did not stop: %s", p.name, end.__name__)
                    end()
                    p.join(2)
        for c in self.conns:
            c.close()


def start_workers(mode: str, tp: int, tmpdir: str) -> Workers:
    ctx = mp.get_context("fork")  # no vLLM re-import per worker; the coordinator has no other thread now
    w = Workers(addrs=[f"ipc://{tmpdir}/{mode}-{tp}-{r}.ipc" for r in range(tp)])
    try:
        for rank in range(tp):
            ours, theirs = ctx.Pipe()
            w.conns.append(ours)
            w.procs.append(ctx.Process(target=worker_main, args=(rank, mode, theirs, list(w.conns), w.addrs[rank]),
                                       name=f"fanout-{mode}-{rank}", daemon=True))
            w.procs[-1].start()
            theirs.close()
    except BaseException:
        w.stop()
        raise
    return w
