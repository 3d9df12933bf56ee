"""KVPathConnector: the thin vLLM adapter (``KVConnectorBase_V1``).

vLLM builds it twice: role SCHEDULER in EngineCore (-> KVPathScheduler) and role
WORKER in each worker (-> KVPathWorker, which owns the transfer engine).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.stall_watch import enable_dump_signal
from kvpath.connector.vllm_compat import attention_backend, compat_fields, refuse_unsupported
from kvpath.connector.vllm_scheduler import KVPathMetadata, KVPathScheduler

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _share_vllm_logging() -> None:
    """Our modules log under ``kvpath.*``; route them through vLLM's handlers."""
    ours, theirs = logging.getLogger("kvpath"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KVPathConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_logging()
        enable_dump_signal()  # kill -USR1 on this process: every thread's stack in its log
        ktc = self._kv_transfer_config
        self.cfg = KVPathConfig.from_extra_config(ktc.kv_connector_extra_config)
        if ktc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"kv_transfer_config.kv_role must be kv_producer, kv_consumer or kv_both, got {ktc.kv_role!r}")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            # SupportsHMA is declared for what works under the hybrid manager: one group.
            raise ConfigError(
                "KVPathConnector pushes one KV cache group (full attention); with the hybrid KV cache "
                f"manager this model has {len(kv_cache_config.kv_cache_groups)}. Start vLLM with "
                "--disable-hybrid-kv-cache-manager to give it one group."
            )
        refuse_unsupported(vllm_config)
        from kvpath.connector.nixl_io import load_nixl

        load_nixl()  # fail at start-up, naming the missing piece, not at the first request
        self.engine_id = self.cfg.engine_id or ktc.engine_id
        self._scheduler: KVPathScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVPathScheduler(vllm_config, self.cfg, self.engine_id)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvpath.connector.vllm_worker import KVPathWorker

            self._worker = KVPathWorker(
                self.cfg, self.engine_id, ktc.kv_role, vllm_config.cache_config.block_size,
                kv_cache_config.num_blocks, rank=get_tensor_model_parallel_rank(), compat=compat_fields(vllm_config, self.cfg),
            )

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self._worker is not None
        # the model is loaded now: its layers say which attention backend they use
        self._worker.compat_fields["attention_backend"] = attention_backend(self._vllm_config)
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVPathMetadata):
            # before the forward (start_load_kv may come after it): the step's commands
            self._worker.begin_forward(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # the step's commands were handed over when vLLM bound them (bind_connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pushes land between steps; nothing to wait for inside a forward

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # push_granularity=layer: tells the writer this layer's KV is written (no I/O here)
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self):
        if self._worker is None:
            return None
        w = self._worker.stats.take_window()
        if w is None:
            return None
        from kvpath.connector.vllm_metrics import KVPathStats, window_to_data

        return KVPathStats(data=window_to_data(w))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from kvpath.connector.vllm_metrics import KVPathStats

        return KVPathStats(data=data) if data is not None else KVPathStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from kvpath.connector.vllm_metrics import KVPathPromMetrics

        return KVPathPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
