"""Control fan-out to TP workers: how long one connector command takes to reach every TP rank's engine thread.

vllm-mq is kvpath's path today: the coordinator (vLLM's EngineCore) enqueues the metadata on
vLLM's shared-memory MessageQueue (one writer, TP local readers); each worker's main thread
dequeues it and hands it to kvpath's EngineThread (SimpleQueue + one-byte wake on an inproc
ZMQ PAIR), which acks on the worker's response MessageQueue(1, 1), read rank by rank as
vLLM's MultiprocExecutor does. sequential / threads / asyncio (as kvcached's TP IPC
benchmark) use a direct channel per rank, a ZMQ DEALER to a ROUTER over ipc:// that the
engine thread polls beside its wake socket: one rank after the other, one pool thread per
rank, or one coroutine per rank. Latency: from the send until every rank's ack is in. CPU:
the coordinator's process time plus every worker's, read in-band around the measured ops.

    flock /tmp/kvpath-heavy.lock .venv/bin/python benchmarks/bench_tp_fanout.py [--tp 1,2,4] [--ops 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq
import zmq.asyncio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpath.connector.config import KVPathConfig
from kvpath.connector.engine_thread import DORMANT_POLL_MS, EngineThread
from kvpath.connector.messages import BlockLayout
from kvpath.connector.step_commands import RecvReq, SendReq, StepCommands

logger = logging.getLogger("bench_tp_fanout")

METHODS = ("vllm-mq", "sequential", "threads", "asyncio")
OPERATIONS = ("registration", "push-start")
OP_TIMEOUT_S, SETUP_TIMEOUT_S, STOP_TIMEOUT_S = 10.0, 30.0, 5.0  # generous: TP 8 on 2 cores is oversubscribed
# vLLM sizes its ring with VLLM_MQ_MAX_CHUNK_BYTES_MB (16 MiB) x 10 chunks; a small
# message takes the same path in a 1 MiB chunk, and /dev/shm stays small at TP 8.
CHUNK_BYTES, MAX_CHUNKS = 1 << 20, 10
Ack = tuple[int, int, float]  # (operation's seq, rank, the worker's process time for a "cpu" op)


@dataclass
class Op:
    seq: int
    kind: str  # an OPERATIONS entry, or "cpu" (the ack carries the worker's process time)
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
    """kvpath's engine thread with only its hand-over: an operation comes by ``_put``
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
        events = self._poll(DORMANT_POLL_MS)
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
            thread._put("op", cmd.dequeue(indefinite=True))  # what KVPathWorker.process_metadata does
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


# ---------------------------------------------------------------- coordinator side

class Fanout:
    name = ""

    def __init__(self, workers: Workers):
        self.tp = len(workers.procs)

    def fanout(self, op: Op) -> list[Ack]:
        raise NotImplementedError

    def check(self, acks: list[Ack], seq: int) -> None:
        if sorted(a[1] for a in acks) != list(range(self.tp)) or any(a[0] != seq for a in acks):
            raise RuntimeError(f"operation {seq}: wrong acks {acks}")

    def timed(self, ops: list[Op], tick: Callable[[], None]) -> list[int]:
        """Nanoseconds per operation, operations back to back."""
        out = []
        for op in ops:
            t0 = time.perf_counter_ns()
            acks = self.fanout(op)
            out.append(time.perf_counter_ns() - t0)
            self.check(acks, op.seq)
            tick()
        return out

    def close(self) -> None:
        pass


class MqFanout(Fanout):
    name = "vllm-mq"

    def __init__(self, workers: Workers):
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        super().__init__(workers)
        # every reader local, as MultiprocExecutor's rpc_broadcast_mq on one node
        self.bcast = MessageQueue(self.tp, self.tp, max_chunk_bytes=CHUNK_BYTES, max_chunks=MAX_CHUNKS)
        for c in workers.conns:
            c.send(self.bcast.export_handle())
        self.resp = [MessageQueue.create_from_handle(workers.recv(r), 0) for r in range(self.tp)]
        for mq in (self.bcast, *self.resp):  # vLLM's wait_until_ready blocks forever on a dead peer: bound it
            mq.local_socket.setsockopt(zmq.RCVTIMEO, int(SETUP_TIMEOUT_S * 1000))
            try:
                mq.wait_until_ready()
            except zmq.Again:
                raise TimeoutError("vLLM MessageQueue set-up timed out") from None
            mq.local_socket.setsockopt(zmq.RCVTIMEO, -1)

    def fanout(self, op: Op) -> list[Ack]:
        self.bcast.enqueue(op)
        return [mq.dequeue(timeout=OP_TIMEOUT_S) for mq in self.resp]

    def close(self) -> None:
        del self.bcast, self.resp  # the last references: the broadcast ring's __del__ unlinks it from /dev/shm


class SequentialFanout(Fanout):
    """One DEALER per rank, to the ROUTER its engine thread polls; one rank after the other."""

    name = "sequential"

    def __init__(self, workers: Workers, ctx: zmq.Context | None = None):
        super().__init__(workers)
        if any(workers.recv(r) != "ready" for r in range(self.tp)):
            raise RuntimeError("a worker failed to start")
        self.addrs, self.ctx = workers.addrs, ctx or zmq.Context()
        self.socks = [self._dealer(a) for a in self.addrs]

    def _dealer(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        return s

    def _roundtrip(self, s: zmq.Socket, payload: bytes) -> Ack:
        s.send(payload)
        if not s.poll(int(OP_TIMEOUT_S * 1000)):
            raise TimeoutError(f"no ack in {OP_TIMEOUT_S:g} s")
        return pickle.loads(s.recv())

    def fanout(self, op: Op) -> list[Ack]:
        payload = pickle.dumps(op)  # once, as vLLM's enqueue pickles once
        return [self._roundtrip(s, payload) for s in self.socks]

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


class ThreadsFanout(SequentialFanout):
    name = "threads"

    def __init__(self, workers: Workers):
        super().__init__(workers)
        self.pool = ThreadPoolExecutor(max_workers=self.tp, thread_name_prefix="fanout")

    def fanout(self, op: Op) -> list[Ack]:
        # A rank's socket serves one task per operation and the next starts after this
        # one's result is taken: a ZMQ socket may move between threads across such a barrier.
        payload = pickle.dumps(op)
        futures = [self.pool.submit(self._roundtrip, s, payload) for s in self.socks]
        return [f.result(OP_TIMEOUT_S) for f in futures]

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # first: the sockets' threads are done with them
        super().close()


class AsyncioFanout(SequentialFanout):
    name = "asyncio"

    def __init__(self, workers: Workers):
        super().__init__(workers, zmq.asyncio.Context())
        self.loop = asyncio.new_event_loop()

    async def _one(self, s: zmq.asyncio.Socket, payload: bytes) -> Ack:
        await s.send(payload)
        return pickle.loads(await s.recv())

    async def _fanout(self, op: Op) -> list[Ack]:
        payload = pickle.dumps(op)
        async with asyncio.timeout(OP_TIMEOUT_S):
            return list(await asyncio.gather(*(self._one(s, payload) for s in self.socks)))

    def fanout(self, op: Op) -> list[Ack]:
        return self.loop.run_until_complete(self._fanout(op))

    def timed(self, ops: list[Op], tick: Callable[[], None]) -> list[int]:
        async def run() -> list[int]:  # one running loop for all operations, as an asyncio coordinator has
            out = []
            for op in ops:
                t0 = time.perf_counter_ns()
                acks = await self._fanout(op)
                out.append(time.perf_counter_ns() - t0)
                self.check(acks, op.seq)
                tick()
            return out
        return self.loop.run_until_complete(run())

    def close(self) -> None:
        super().close()
        self.loop.close()


FANOUTS: dict[str, type[Fanout]] = {f.name: f for f in (MqFanout, SequentialFanout, ThreadsFanout, AsyncioFanout)}


@dataclass
class Row:
    method: str
    operation: str
    tp: int
    ops: int
    mean_us: float
    p95_us: float
    max_us: float
    min_us: float
    wall_per_op_us: float
    cpu_per_op_us: float  # coordinator + every worker
    coordinator_cpu_per_op_us: float
    cores_busy: float  # that CPU time / wall time


def measure(fan: Fanout, kind: str, n_ops: int, warmup: int, seq: int, tick: Callable[[], None]) -> Row:
    rng = random.Random(seq)  # the same payloads for every method
    ops = [make_op(seq + i, kind, rng) for i in range(warmup + n_ops)]
    fan.timed(ops[:warmup], lambda: None)
    before = fan.fanout(Op(seq - 1, "cpu"))
    c0, w0 = time.process_time(), time.perf_counter()
    lat = np.array(fan.timed(ops[warmup:], tick)) / 1000
    wall, coord = time.perf_counter() - w0, time.process_time() - c0
    total = coord + sum(a[2] for a in fan.fanout(Op(seq - 2, "cpu"))) - sum(b[2] for b in before)
    return Row(fan.name, kind, fan.tp, n_ops, float(lat.mean()), float(np.percentile(lat, 95)), float(lat.max()),
               float(lat.min()), wall / n_ops * 1e6, total / n_ops * 1e6, coord / n_ops * 1e6, total / wall)


def run_config(method: str, tp: int, n_ops: int, warmup: int, tmpdir: str, tick: Callable[[], None]) -> list[Row]:
    workers = start_workers(method, tp, tmpdir)
    fan: Fanout | None = None
    try:
        fan = FANOUTS[method](workers)
        return [measure(fan, kind, n_ops, warmup, 1_000_000 * (i + 1), tick) for i, kind in enumerate(OPERATIONS)]
    finally:
        try:
            if fan is not None:
                fan.close()
        finally:
            workers.stop()


def run(methods: list[str], tps: list[int], n_ops: int, warmup: int, console: Console) -> list[Row]:
    from multiprocessing import resource_tracker

    if "vllm-mq" in methods:  # before any fork, so that no worker imports vLLM (seconds) on its own
        import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401
    resource_tracker.ensure_running()  # before any fork: one tracker, which unlinks what a crash leaks
    rows: list[Row] = []
    # auto_refresh off: no refresher thread in the coordinator when it forks, none in its CPU time
    with tempfile.TemporaryDirectory(prefix="kvfan-") as tmpdir, \
            Progress(console=console, auto_refresh=False, transient=True) as progress:
        task = progress.add_task("fan-out", total=len(methods) * len(tps) * len(OPERATIONS) * n_ops)
        count = iter(range(1, 1 << 62))

        def tick() -> None:
            if next(count) % 250 == 0:
                progress.update(task, advance=250, refresh=True)
        for tp in tps:
            for method in methods:
                progress.update(task, description=f"{method} TP {tp}", refresh=True)
                rows.extend(run_config(method, tp, n_ops, warmup, tmpdir, tick))
    return rows


def cpu_sample() -> np.ndarray:
    """(monotonic s, machine busy CPU s, steal s, this run's CPU s incl. reaped workers)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    hz, t = os.sysconf("SC_CLK_TCK"), os.times()
    return np.array([time.monotonic(), (user + nice + system + irq + softirq) / hz, steal / hz,
                     t.user + t.system + t.children_user + t.children_system])


def print_table(rows: list[Row], note: str) -> None:
    console = Console()
    if not console.is_terminal:
        console.width = 150  # a file or a pipe: the whole table, no ellipses
    t = Table(title="Control fan-out to TP workers: one operation to every rank's engine thread and back (µs)",
              caption=note)
    for col in ("method", "operation", "TP", "mean", "p95", "max", "min", "wall/op", "CPU/op", "coord CPU/op",
                "cores busy"):
        t.add_column(col, justify="left" if col in ("method", "operation") else "right")
    for r in rows:
        t.add_row(r.method, r.operation, str(r.tp), *(f"{v:.0f}" for v in (
            r.mean_us, r.p95_us, r.max_us, r.min_us, r.wall_per_op_us, r.cpu_per_op_us, r.coordinator_cpu_per_op_us)),
            f"{r.cores_busy:.2f}")
    console.print(t)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _list(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            values = list(dict.fromkeys(kind(v.strip()) for v in text.split(",") if v.strip()))
        except ValueError:
            values = []
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return values
    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="bench_tp_fanout.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=_list(int, lambda v: 1 <= v <= 8, "TP sizes in 1-8, comma separated"),
                   default=[1, 2, 4], help="worker process counts, comma separated (default 1,2,4; 8 is allowed "
                   "and measures oversubscription on a 2-core machine)")
    p.add_argument("--methods", type=_list(str, lambda v: v in METHODS, f"some of {','.join(METHODS)}"),
                   default=list(METHODS), help=f"fan-out methods, comma separated (default {','.join(METHODS)})")
    p.add_argument("--ops", type=_positive, default=2000,
                   help="measured operations per method, operation and TP (default %(default)s)")
    p.add_argument("--warmup", type=_positive, default=200, help="unmeasured operations before (default %(default)s)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the rows and the run's CPU use as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C, through the finally blocks
    cores = len(os.sched_getaffinity(0))
    if over := [tp for tp in args.tp if tp + 1 > cores]:
        logger.warning("TP %s: that many worker processes and the coordinator on %d cores measure oversubscription "
                       "(vllm-mq's readers spin on sched_yield)", ",".join(map(str, over)), cores)
    s0 = cpu_sample()
    try:
        rows = run(args.methods, args.tp, args.ops, args.warmup, Console(stderr=True))
    except (TimeoutError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted (every worker stopped)")
        return 130
    wall, busy, steal, ours = cpu_sample() - s0
    others = max(0.0, busy - ours) / wall
    print_table(rows, f"{args.ops} ops each after {args.warmup} warm-up, back to back, {wall:.0f} s on {cores} cores; "
                f"this run used {ours / wall:.2f} cores on average, other processes {others:.2f}, steal "
                f"{steal / wall:.2f}: contention inflates the tails")
    if args.json:
        args.json.write_text(json.dumps({"cores": cores, "wall_s": wall, "ours_cores": ours / wall,
                                         "others_cores": others, "steal_cores": steal / wall, "ops": args.ops,
                                         "warmup": args.warmup, "rows": [asdict(r) for r in rows]}, indent=1))
        logger.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
