"""The core of an emulated engine: continuous batching on an iteration-time model,
with real KV bytes pushed by the connector's own transfer engine.

A prefill (P) engine queues prompts, runs them in batches (a token budget per
iteration, whole prompts), sleeps each iteration's modelled time, and hands each
finished prompt's blocks to :class:`kvpath.connector.sender.PushSender` exactly as the vLLM
adapter does; its blocks are freed when the sender says so. A decode (D) engine
allocates blocks, registers them with :class:`kvpath.connector.receiver.PushReceiver`,
waits for the KV, then decodes all its running requests together, one token per
iteration at the modelled decode pace. A push that fails is recomputed locally (a
modelled prefill on D), as vLLM does by default.

Times come from the iteration-time model in datacenter seconds and are multiplied by
the scale model's ``time_scale`` (B/S). No HTTP here: ``testbed/emulated_server.py``
serves it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from kvpath.layer_push import layer_done_times

logger = logging.getLogger(__name__)


class TimeModel(Protocol):
    def prefill_time(self, tokens: list[int]) -> float: ...

    def decode_time(self, contexts: list[int]) -> float: ...


@dataclass(frozen=True)
class EngineSpec:
    role: str  # "prefill" | "decode"
    kv_bytes_per_token: int  # testbed bytes per token (the model's divided by S)
    block_size: int = 16
    num_blocks: int = 8192
    max_batch_tokens: int = 8192  # prefill tokens per iteration
    max_num_seqs: int = 256  # running decodes
    time_scale: float = 1.0  # B/S: modelled (datacenter) seconds -> testbed seconds
    # P: the model's layers (the KV layout's regions) and when its KV leaves: "request"
    # after the prefill, or "layer" in groups of layer_group as the iteration computes
    # them (kvpath.layer_push: layers take equal shares of the iteration's time)
    layers: int = 1
    push_granularity: str = "request"
    layer_group: int = 1

    @property
    def block_bytes(self) -> int:
        return max(64, self.kv_bytes_per_token * self.block_size)

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_size))


class BlockPool:
    def __init__(self, n: int):
        self.free_ids: deque[int] = deque(range(n))
        self.n = n

    def alloc(self, k: int) -> list[int] | None:
        if k > len(self.free_ids):
            return None
        return [self.free_ids.popleft() for _ in range(k)]

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)

    @property
    def usage(self) -> float:
        return 1 - len(self.free_ids) / self.n


@dataclass
class EmuRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    transfer_id: str = ""
    peer: str = ""  # D: P's kv address
    lane: int | None = None
    lease_id: str | None = None
    transfer_key: str = ""  # the transfer's secret (both legs); never written to the trace
    blocks: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.time)
    prefill_start: float | None = None
    prefill_end: float | None = None
    kv_ready: float | None = None
    decode_start: float | None = None
    first_token: float | None = None
    completion: float | None = None
    generated: int = 0
    recomputed: bool = False
    status: str = "ok"
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)

    def record(self) -> dict[str, Any]:
        keys = ("request_id", "transfer_id", "prompt_tokens", "max_tokens", "lane", "lease_id", "arrival",
                "prefill_start", "prefill_end", "kv_ready", "decode_start", "first_token", "completion",
                "generated", "recomputed", "status")
        return {k: getattr(self, k) for k in keys}


class EmulatedEngine:
    def __init__(self, spec: EngineSpec, model: TimeModel, sender: Any = None, receiver: Any = None):
        if spec.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {spec.role!r}")
        self.spec = spec
        self.model = model
        self.sender = sender
        self.receiver = receiver
        self.pool = BlockPool(spec.num_blocks)
        self.waiting: deque[EmuRequest] = deque()  # P: to prefill; D: waiting for blocks
        self.kv_wait: dict[str, EmuRequest] = {}  # D: registered, KV not yet here
        self.recompute: deque[EmuRequest] = deque()  # D: KV failed, prefill locally
        self.running: list[EmuRequest] = []  # D: decoding
        self.pushing: dict[str, EmuRequest] = {}  # P: handed to the sender, blocks held
        self.records: deque[dict[str, Any]] = deque(maxlen=100_000)
        self.counters = {"requests": 0, "recomputed": 0, "failed": 0, "iterations": 0}
        self.forward = 0  # P: the iteration counter the sender's layer reports name
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- entry points ---------------------------------------------------------------
    async def prefill(self, req: EmuRequest) -> EmuRequest:
        """P: returns once the prompt is prefilled and its push handed to the sender."""
        self.counters["requests"] += 1
        self.waiting.append(req)
        self._wake.set()
        await req.done.wait()
        return req

    async def generate(self, req: EmuRequest) -> AsyncIterator[int]:
        """D: yields token indices as they are decoded (the KV arrives first)."""
        self.counters["requests"] += 1
        self.waiting.append(req)
        self._wake.set()
        while True:
            tok = await req.tokens.get()
            if tok is None:
                return
            yield tok

    def abort(self, req: EmuRequest) -> None:
        """The client went away: D cancels its registration (the receiver frees the
        blocks when safe); a queued request just leaves."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.request_id in self.kv_wait and self.receiver is not None:
            req.status = "aborted"  # its blocks are freed when the receiver releases them
            self.receiver.cancel(req.request_id)
        elif req in self.running:
            self.running.remove(req)
            self._finish(req, "aborted")

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                busy = await (self._step_prefill() if self.spec.role == "prefill" else self._step_decode())
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad step must not stop the engine
                logger.exception("emulated engine step failed")
                busy = False
            if not busy:
                # nothing to compute: wait for a request, or poll the connector soon
                # when something waits on it (a push in flight, KV expected)
                polling = bool(self.pushing or self.kv_wait or self.waiting)
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.002 if polling else 1.0)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()

    def _poll_sender(self) -> None:
        if self.sender is None:
            return
        for rid in self.sender.take_finished():
            req = self.pushing.pop(rid, None)
            if req is not None:
                self.pool.free(req.blocks)

    async def _step_prefill(self) -> bool:
        self._poll_sender()
        batch: list[EmuRequest] = []
        budget = self.spec.max_batch_tokens
        while self.waiting and (not batch or self.waiting[0].prompt_tokens <= budget):
            req = self.waiting[0]
            blocks = self.pool.alloc(self.spec.blocks_for(req.prompt_tokens))
            if blocks is None:
                break  # wait for pushes to finish and free blocks
            self.waiting.popleft()
            req.blocks = blocks
            budget -= req.prompt_tokens
            batch.append(req)
        if not batch:
            return False
        t0 = time.time()
        for r in batch:
            r.prefill_start = t0
        duration = self.model.prefill_time([r.prompt_tokens for r in batch]) * self.spec.time_scale
        pushed = [r for r in batch if self.sender is not None and r.transfer_id]
        if pushed and self.spec.push_granularity == "layer":
            await self._layered_iteration(pushed, t0, duration)
        else:
            await asyncio.sleep(duration)
        self.counters["iterations"] += 1
        t1 = time.time()
        for r in batch:
            r.prefill_end = t1
            if r in pushed:
                self.pushing[r.request_id] = r
                self.sender.submit_finished(r.request_id, r.transfer_id, r.blocks, r.lane, r.lease_id,
                                            transfer_key=r.transfer_key)
            else:
                self.pool.free(r.blocks)
            self._finish(r, "ok")
        return True

    async def _layered_iteration(self, pushed: list[EmuRequest], t0: float, duration: float) -> None:
        """An iteration whose prompts push layer-wise: begun before it, each layer group
        reported as its modelled time passes, as vLLM's save_kv_layer reports them."""
        self.forward += 1
        layers, group = self.spec.layers, self.spec.layer_group
        for r in pushed:
            self.sender.begin(r.request_id, r.transfer_id, r.blocks, r.lane, r.lease_id, r.transfer_key,
                              self.forward, layers)
        # the reports on timers, the iteration one sleep: its length is the model's, as
        # with request granularity, whatever the timers' wake-ups cost
        loop = asyncio.get_running_loop()
        base = loop.time() - (time.time() - t0)
        done_at = layer_done_times(0.0, duration, layers)
        timers = [loop.call_at(base + done_at[n - 1], self.sender.layers_done, self.forward, n)
                  for n in range(group, layers, group)]
        try:
            await asyncio.sleep(max(0.0, t0 + duration - time.time()))
        finally:
            for h in timers:
                h.cancel()
        self.sender.forward_done(self.forward, layers)

    def _poll_receiver(self) -> None:
        if self.receiver is None:
            return
        released, failed = self.receiver.take()
        now = time.time()
        for rid in released:
            req = self.kv_wait.pop(rid, None)
            if req is None:
                continue
            req.kv_ready = now
            if req.status == "aborted":
                self.pool.free(req.blocks)
                self._finish(req, "aborted")
            elif rid in failed:
                # vLLM's default on a failed KV load: compute the prompt here
                req.recomputed = True
                self.counters["recomputed"] += 1
                self.recompute.append(req)
            else:
                self.running.append(req)

    async def _step_decode(self) -> bool:
        self._poll_receiver()
        while self.waiting and len(self.running) + len(self.kv_wait) < self.spec.max_num_seqs:
            req = self.waiting[0]
            blocks = self.pool.alloc(self.spec.blocks_for(req.prompt_tokens + req.max_tokens))
            if blocks is None:
                break
            self.waiting.popleft()
            req.blocks = blocks
            if self.receiver is not None and req.transfer_id:
                self.kv_wait[req.request_id] = req
                n = self.spec.blocks_for(req.prompt_tokens)
                self.receiver.register(req.request_id, req.transfer_id, req.peer, blocks[:n],
                                       transfer_key=req.transfer_key)
            else:
                self.recompute.append(req)  # no remote prefill: D computes the prompt itself
        if self.recompute:
            batch = [self.recompute.popleft() for _ in range(len(self.recompute))]
            await asyncio.sleep(self.model.prefill_time([r.prompt_tokens for r in batch]) * self.spec.time_scale)
            self.running.extend(batch)
        if not self.running:
            return False
        now = time.time()
        for r in self.running:
            if r.decode_start is None:
                r.decode_start = now
        contexts = [r.prompt_tokens + r.generated for r in self.running]
        await asyncio.sleep(self.model.decode_time(contexts) * self.spec.time_scale)
        self.counters["iterations"] += 1
        now = time.time()
        still = []
        for r in self.running:
            if r.first_token is None:
                r.first_token = now
            r.tokens.put_nowait(r.generated)
            r.generated += 1
            if r.generated >= r.max_tokens:
                self.pool.free(r.blocks)
                self._finish(r, "ok")
            else:
                still.append(r)
        self.running = still
        return True

    def _finish(self, req: EmuRequest, status: str) -> None:
        req.status = status
        req.completion = time.time()
        self.records.append(req.record())
        req.tokens.put_nowait(None)
        req.done.set()
