"""Scheduler side of KVPathConnector (runs in vLLM's EngineCore process).

It decides, per request, what the worker side must do next step, and hands it
over in :class:`KVPathMetadata`. No networking here.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpath.connector.config import KVPathConfig
from kvpath.connector.params import BadTransferParams, parse_decode, parse_prefill
from kvpath.connector.step_commands import ComputeReq, RecvReq, SendReq, StepCommands, VllmTimes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
SPENT_REMEMBERED = 4096  # ended transfers whose late n > 1 children are told apart
SIBLING_CACHE_STEPS = 4  # steps an n > 1 child waits after the push landed for the prefix cache


@dataclass
class _Owner:
    """The live D request that registered a transfer (n > 1: its siblings wait for it)."""

    request_id: str
    prompt: int  # a hash of its prompt's token ids: only children with the same prompt share
    landed_step: int | None = None  # the scheduler step its push landed at


@dataclass
class KVPathMetadata(StepCommands, KVConnectorMetadata):
    """The step's commands (:mod:`kvpath.connector.step_commands`) as vLLM's metadata."""


def _public_key(cfg: KVPathConfig) -> str | None:
    if not cfg.control_key:
        return None
    import zmq.auth  # here, not at import: the plugin hook imports this package without ZMQ

    public, _ = zmq.auth.load_certificate(cfg.control_key)
    return public.decode()


class KVPathScheduler:
    def __init__(self, vllm_config: "VllmConfig", cfg: KVPathConfig, engine_id: str):
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        ktc = vllm_config.kv_transfer_config
        self.role = ktc.kv_role if ktc is not None else "kv_both"
        self.public_key = _public_key(cfg)  # P's answer names it: D's server key for us
        self._meta = KVPathMetadata()
        self._p_pending: set[str] = set()  # P requests whose blocks the writer holds
        self._d_waiting: set[str] = set()  # D requests registered, KV not yet arrived
        self._d_cancelled: set[str] = set()  # D requests ended while waiting
        # requests whose flags do not fit kv_role -> the error their answer carries
        # (one entry per live request: request_finished removes it)
        self._role_errors: dict[str, str] = {}
        # transfer id -> the live D request that registered it. vLLM serves n > 1 as child
        # requests sharing the prompt and its kv_transfer_params: one of them receives the
        # push, the others wait for it and take its blocks from the prefix cache.
        self.owners: dict[str, _Owner] = {}
        self._owned: dict[str, str] = {}  # request id -> the transfer id it owns
        self._step = 0  # build_connector_meta calls: the scheduler's steps
        # transfers whose owner ended (the last SPENT_REMEMBERED): a child that comes
        # later computes its prefill locally instead of registering a spent id again
        self._spent: OrderedDict[str, int] = OrderedDict()  # -> hash of its prompt
        self.prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        # P requests not yet scheduled (their events are read when they are) and the times
        # read: live requests only (request_finished drops both)
        self._p_unscheduled: dict[str, "Request"] = {}
        self._p_times: dict[str, VllmTimes] = {}
        # vLLM stamps its events with time.monotonic(): this maps them to unix time
        self._mono_to_unix = time.time() - time.monotonic()
        # push_granularity=layer (P): live P requests, their blocks so far, and those whose
        # push has begun (request id -> transfer id) until request_finished
        self.layer_push = self.role in ("kv_producer", "kv_both") and self._layer_push_supported(vllm_config)
        self._p_live: dict[str, "Request"] = {}
        self._p_blocks: dict[str, list[int]] = {}
        self._p_begun: dict[str, str] = {}
        self._p_final: dict[str, int] = {}  # begun request -> tokens its push's own forwards made final

    def _layer_push_supported(self, vllm_config: "VllmConfig") -> bool:
        """Layer-wise push needs a KV cache written by the time save_kv_layer is called (the
        CPU's: a GPU's would need a CUDA event per layer, not built) and one step in flight
        at a time (with asynchronous scheduling a request whose last forward is in flight
        can be preempted and its blocks reused under a WRITE). Elsewhere every push is whole."""
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        async_sched = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        ok = device == "cpu" and not async_sched
        if not ok and self.cfg.push_granularity != "request":
            logger.warning("push_granularity=%s needs a CPU KV cache and synchronous scheduling (device %s, async "
                           "scheduling %s): every push goes whole", self.cfg.push_granularity, device, async_sched)
        return ok

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and request.request_id not in self._p_times:
            self._p_unscheduled[request.request_id] = request  # its events are read once scheduled
        if self.layer_push and params and params.get("do_remote_decode"):
            self._p_live[request.request_id] = request
        try:
            dp = parse_decode(request.kv_transfer_params)
        except BadTransferParams as e:
            logger.warning("request %s: %s; computing its prefill locally", request.request_id, e)
            request.kv_transfer_params = None
            return 0, False
        if dp is None:
            return 0, False
        if self.role == "kv_producer":
            # no receiver here: waiting for a push would hold the request and its blocks.
            # The connector API cannot refuse a request, so it is computed locally and its
            # answer's kv_transfer_params carry the error (the proxy fails such a leg).
            why = "do_remote_prefill sent to an engine whose kv_role is kv_producer: prefill computed locally"
            logger.error("request %s: %s", request.request_id, why)
            request.kv_transfer_params = None
            self._role_errors[request.request_id] = why
            return 0, False
        owner = self.owners.get(dp.transfer_id)
        if owner is not None or dp.transfer_id in self._spent:
            prompt = hash(tuple(request.prompt_token_ids or ()))
            if owner is not None and owner.request_id != request.request_id and owner.prompt == prompt:
                return self._sibling(request, owner, num_computed_tokens)
            if owner is None and self._spent.get(dp.transfer_id) == prompt:
                return self._sibling(request, None, num_computed_tokens)
            # another prompt under a taken transfer id is a reused id: it registers, and
            # P or D refuses it at once as a duplicate
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _sibling(self, request: "Request", owner: "_Owner | None", num_computed_tokens: int) -> tuple[int | None, bool]:
        """A request (a child of an ``n`` > 1 request, same prompt) whose transfer another
        live request receives: it waits (None: vLLM asks again next step) until that KV
        has landed and the owner's full blocks are in the prefix cache, then computes the
        rest locally (less than a block). It waits at most SIBLING_CACHE_STEPS steps after
        the landing for the cache (some configurations never hit every full block: a
        speculative decoder drops the last one), then computes what it lacks. Without
        prefix caching it computes its prefill at once. ``owner`` None: the owner ended."""
        if self.prefix_caching and owner is not None:
            if owner.request_id in self._d_waiting:
                return None, False
            prompt = len(request.prompt_token_ids or [])
            landed = owner.landed_step if owner.landed_step is not None else self._step
            if (num_computed_tokens < (prompt - 1) // self.block_size * self.block_size
                    and self._step - landed < SIBLING_CACHE_STEPS):
                return None, False  # landed; cached once the owner is scheduled (next step)
        request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}
        logger.debug("request %s shares transfer of %s: %d tokens from the prefix cache", request.request_id,
                     owner.request_id if owner is not None else "an ended request", num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        dp = parse_decode(params)  # validated in get_num_new_matched_tokens
        assert dp is not None
        all_ids = blocks.get_block_ids()[0]
        new_ids = blocks.get_unhashed_block_ids()
        skip = len(all_ids) - len(new_ids)  # local prefix hits come first
        self._meta.registrations.append(RecvReq(request.request_id, dp.transfer_id, dp.peer, list(new_ids), skip,
                                                dp.peer_key, dp.transfer_key, dp.tp_size))
        self._d_waiting.add(request.request_id)
        if dp.transfer_id not in self.owners:  # a live owner is never replaced (a reused id fails)
            self.owners[dp.transfer_id] = _Owner(request.request_id, hash(tuple(request.prompt_token_ids or ())))
            self._owned[request.request_id] = dp.transfer_id
        params["do_remote_prefill"] = False  # a re-entry after preemption must not register again

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVPathMetadata:
        meta, self._meta = self._meta, KVPathMetadata()
        self._step += 1
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self._p_unscheduled:
            for new in scheduler_output.scheduled_new_reqs:
                req = self._p_unscheduled.pop(new.req_id, None)
                if req is not None:
                    self._p_times[new.req_id] = self._times_of(req)
        if self._p_live:
            self._begin_layer_pushes(scheduler_output, meta)
        return meta

    def _begin_layer_pushes(self, out: "SchedulerOutput", meta: KVPathMetadata) -> None:
        """push_granularity layer or chunk: the P requests whose push this step's forward
        feeds. ``layer``: the forward that completes the prompt; ``chunk``: every forward
        of a chunked prefill, each earlier chunk's whole blocks pushed while the next
        computes. Only a request that ends after its last forward (max_tokens 1, as the
        proxy's P leg), never two live requests with one transfer id. A begun request vLLM
        preempts (its blocks freed, as vLLM does without asking the connector) restarts:
        the writer waits for its WRITEs in flight, then pushes it anew from its new blocks."""
        for rid in getattr(out, "preempted_req_ids", None) or ():
            if rid in self._p_begun:
                meta.restarts.append((rid, self._p_begun[rid]))
                self._p_final.pop(rid, None)  # its blocks are freed: nothing it computed stays
        for new in out.scheduled_new_reqs:
            if new.req_id in self._p_live:
                self._p_blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in self._p_live and ids is not None:
                if rid in cached.resumed_req_ids:  # after a preemption: all of its blocks anew
                    self._p_blocks[rid] = list(ids[0])
                else:
                    self._p_blocks.setdefault(rid, []).extend(ids[0])
        busy = set(self._p_begun.values())
        bs = self.block_size
        for rid, n in out.num_scheduled_tokens.items():
            req = self._p_live.get(rid)
            if (req is None or req.max_tokens != 1 or req.num_computed_tokens >= req.num_prompt_tokens
                    or getattr(req, "resumable", False)):
                continue  # not a P leg that ends after its prefill, its prompt is computed, or a session's
            last = req.num_computed_tokens + n >= req.num_prompt_tokens
            tid = self._p_begun.get(rid)
            first = tid is None
            if tid is None:
                try:
                    pp = parse_prefill(req.kv_transfer_params, rid)
                except BadTransferParams:
                    continue  # request_finished says why
                gran = (pp.push_granularity or self.cfg.push_granularity) if pp is not None else "request"
                if gran == "request" or (gran == "layer" and not last) or pp.transfer_id in busy:
                    continue  # whole, an earlier chunk of a layer-wise push, or another live request's id
                tid = self._p_begun[rid] = pp.transfer_id
                busy.add(tid)
                lane, lease, key = pp.lane, pp.lease_id, pp.transfer_key
            else:
                lane, lease, key = None, None, ""  # the writer has them from the begin
            # Final before this forward: only what this push's own earlier forwards computed.
            # A prefix-cache hit's blocks may be another request's that this very forward
            # fills (vLLM caches blocks when it allocates them): they count once it ends.
            before = self._p_final.get(rid, 0)
            after = None if last else (req.num_computed_tokens + n) // bs * bs
            meta.computing.append(ComputeReq(rid, tid, list(self._p_blocks.get(rid, ())), lane, lease, key,
                                             before, after, first))
            self._p_final[rid] = before if after is None else after

    def _times_of(self, request: "Request") -> VllmTimes:
        """vLLM's own records of a request just scheduled (its events are taken after
        this step's forward, so they are all still there): no clock of ours."""
        from vllm.v1.engine import EngineCoreEventType

        queued = scheduled = None
        for ev in getattr(request, "events", None) or ():
            if ev.type == EngineCoreEventType.QUEUED and queued is None:
                queued = ev.timestamp + self._mono_to_unix
            elif ev.type == EngineCoreEventType.SCHEDULED and scheduled is None:
                scheduled = ev.timestamp + self._mono_to_unix
        return VllmTimes(getattr(request, "arrival_time", None), queued, scheduled)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._p_unscheduled.pop(rid, None)
        self._p_live.pop(rid, None)
        self._p_blocks.pop(rid, None)
        begun = self._p_begun.pop(rid, None) is not None
        self._p_final.pop(rid, None)
        times = self._p_times.pop(rid, None)
        tid = self._owned.pop(rid, None)
        if tid is not None:  # siblings still waiting compute their prefill locally
            self._spent[tid] = self.owners.pop(tid).prompt
            if len(self._spent) > SPENT_REMEMBERED:
                self._spent.popitem(last=False)
        role_error = self._role_errors.pop(rid, None)
        if role_error is not None:
            return False, {"error": role_error, "kv_role": self.role}
        if rid in self._d_waiting:  # D gave up before its KV arrived
            self._d_waiting.discard(rid)
            self._d_cancelled.add(rid)
            self._meta.cancels.append(rid)
            return False, None  # vLLM itself holds the blocks until we report them
        try:
            pp = parse_prefill(request.kv_transfer_params, rid)
        except BadTransferParams as e:
            logger.warning("request %s: %s; not pushing its KV", rid, e)
            return False, None
        if pp is None:
            return False, None
        if self.role == "kv_consumer":
            # no writer here: holding the blocks for a push would leak them
            why = "do_remote_decode sent to an engine whose kv_role is kv_consumer: no KV is pushed"
            logger.error("request %s: %s", rid, why)
            return False, {"error": why, "kv_role": self.role}
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not ok or not block_ids:
            if begun:  # its layer WRITEs may read the blocks: the writer frees them once they end
                self._meta.aborted_begun.append((rid, pp.transfer_id))
                self._p_pending.add(rid)
                return True, None
            self._meta.aborted.append(pp.transfer_id)
            return False, None
        self._meta.finished.append(SendReq(rid, pp.transfer_id, list(block_ids), pp.lane, pp.lease_id,
                                           pp.transfer_key, times))
        self._p_pending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvpath": {
                "transfer_id": pp.transfer_id,
                "peer": self.cfg.advertised_addr(0),
                "tp_size": self.tp_size,  # D's ranks find P rank r at the peer's port + r
                **({"peer_key": self.public_key} if self.public_key else {}),
                **({"transfer_key": pp.transfer_key} if pp.transfer_key else {}),
                "engine_id": self.engine_id,
                "lane": pp.lane,
                "num_blocks": len(block_ids),
            },
        }

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        for rid in out.finished_sending or ():
            self._p_pending.discard(rid)
        for rid in out.finished_recving or ():
            self._d_waiting.discard(rid)
            tid = self._owned.get(rid)
            if tid is not None:
                self.owners[tid].landed_step = self._step
            self._d_cancelled.discard(rid)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping so the worker can report completions.
        return bool(self._p_pending or self._d_cancelled or self._meta.registrations or self._meta.finished)
