"""benchmarks/bench_tp_fanout.py's coordinator side: one fan-out per method, each sending an
operation to every TP worker and collecting the acks (vLLM's MessageQueue, or a ZMQ DEALER
per rank: one rank after the other, a thread per rank, a coroutine per rank) (a module the
script imports, not a script)."""

from __future__ import annotations

import asyncio
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import zmq
import zmq.asyncio

from tp_fanout_workers import CHUNK_BYTES, MAX_CHUNKS, OP_TIMEOUT_S, SETUP_TIMEOUT_S, Ack, Op, Workers


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
