"""Worker side of KVPathConnector: hands scheduler decisions to the engine threads."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layout import layout_from_tensors
from kvpath.connector.messages import Compat
from kvpath.connector.vllm_compat import layers_digest
from kvpath.connector.receiver import PushReceiver
from kvpath.connector.sender import PushSender
from kvpath.connector.telemetry import Stats
from kvpath.connector.tp_map import peer_ranks
from kvpath.trace import TraceWriter
from kvpath.connector.vllm_scheduler import KVPathMetadata

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The P ranks one D rank registers a request with (P's TP size over D's): bounds the
# links and flows a request's kvpath.tp_size can make
MAX_FLOWS = 64


class KVPathWorker:
    def __init__(
        self, cfg: KVPathConfig, engine_id: str, role: str, block_size: int, num_blocks: int, rank: int = 0,
        compat: dict | None = None,
    ):
        self.cfg = cfg
        self.engine_id = engine_id
        self.role = role  # kv_producer | kv_consumer | kv_both
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rank = rank
        self.compat_fields = compat or {}  # model, dtype, tp_size (the layout adds the rest)
        self.stats = Stats()
        self.trace = TraceWriter(cfg.trace_path, max_bytes=cfg.trace_max_bytes, keep=cfg.trace_keep)
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None
        self.tp_size = int(self.compat_fields.get("tp_size", 1) or 1)
        self.idle_wait_s = cfg.idle_step_wait_s(self.tp_size)
        self.results_ready = threading.Event()  # shared by the writer and the receiver
        # push_granularity=layer: the KV layers in registration order (regions follow it),
        # the forward counter, and this forward's layers saved (vLLM's call order need not
        # be the registration order: the writer is told the prefix all saved)
        self.layer_index: dict[str, int] = {}
        self.forward = 0
        self._saved: list[bool] = []
        self._saved_prefix = 0
        self._pushing = False  # this forward completes a prompt whose push is layer-wise

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        layout, spans = layout_from_tensors(list(kv_caches.values()), self.num_blocks, self.block_size)
        logger.info(
            "kvpath: %d KV tensors -> %d regions, %d B per block, %d blocks (%s)",
            len(kv_caches), len(layout.regions), layout.bytes_per_block(), layout.num_blocks, self.role,
        )
        compat = Compat(block_size=layout.block_size, kv_layout=layout.shape(), tp_rank=self.rank,
                        layers=layers_digest(kv_caches), **self.compat_fields)
        logger.info("kvpath: compatibility %s (digest %s)", compat, compat.digest())
        if self.role in ("kv_producer", "kv_both"):
            self.sender = PushSender(
                self.cfg, layout, spans, self.engine_id, self.rank, self.stats, self.trace, compat=compat
            )
            self.sender.results_ready = self.results_ready
            self.sender.start()
        if self.role in ("kv_consumer", "kv_both"):
            self.receiver = PushReceiver(
                self.cfg, layout, spans, self.engine_id, self.rank, self.stats, self.trace, compat=compat
            )
            self.receiver.results_ready = self.results_ready
            self.receiver.start()

    def process_metadata(self, meta: KVPathMetadata) -> None:
        if self.receiver is not None:
            for r in meta.registrations:
                host, _, port = r.peer.rpartition(":")
                p_tp = r.p_tp_size or self.tp_size
                try:  # P rank p listens at the advertised port + p
                    ranks = peer_ranks(p_tp, self.tp_size, self.rank, int(self.compat_fields.get("kv_heads") or 0))
                    if len(ranks) > MAX_FLOWS:  # a client's tp_size must not make D open a link per rank
                        raise ValueError(f"{len(ranks)} P ranks for this D rank, at most {MAX_FLOWS}")
                    # never raises on the engine thread: a bad peer or port fails the request only
                    self.receiver.register(r.request_id, r.transfer_id, [f"{host}:{int(port) + p}" for p in ranks],
                                           r.block_ids, r.skip_blocks, peer_key=r.peer_key,
                                           transfer_key=r.transfer_key, p_tp_size=p_tp, peer_ranks=ranks)
                except ValueError as e:
                    self.receiver.refuse(r.request_id, f"P's TP size {p_tp}, D's {self.tp_size}: {e}")
            for rid in meta.cancels:
                self.receiver.cancel(rid)
        if self.sender is not None:
            for s in meta.finished:
                self.sender.submit_finished(s.request_id, s.transfer_id, s.block_ids, s.lane, s.lease_id,
                                            transfer_key=s.transfer_key, times=s.times)
            for tid in meta.aborted:
                self.sender.abort(tid)
            for rid, tid in meta.aborted_begun:
                self.sender.abort(tid, rid)
        if meta.idle and self.idle_wait_s > 0:
            self.wait_for_results(self.idle_wait_s)

    def begin_forward(self, meta: KVPathMetadata) -> None:
        """The step's commands, before its forward (vLLM runs ``start_load_kv`` after the
        forward when no load is synchronous): requests that ended hand over first (a
        layer-wise push commits without waiting for the next forward), then the prompts
        this forward completes begin their layer-wise push."""
        self.forward += 1
        self._pushing = False
        self.process_metadata(meta)
        if self.sender is None:
            return
        for rid, tid in meta.restarts:
            self.sender.restart(tid, rid)
        if not meta.computing:
            return
        for s in meta.computing:
            self.sender.begin(s.request_id, s.transfer_id, s.block_ids, s.lane, s.lease_id, s.transfer_key,
                              self.forward, len(self.layer_index), s.final_before, s.final_after, s.first)
        self._pushing = True
        self._saved, self._saved_prefix = [False] * len(self.layer_index), 0

    def save_kv_layer(self, layer_name: str) -> None:
        """After an attention layer of the forward: its KV is written. Engine thread, so
        only bookkeeping and a deque append."""
        if not self._pushing:
            return
        i = self.layer_index.get(layer_name)
        if i is None or self._saved[i]:
            return
        self._saved[i] = True
        n = self._saved_prefix
        while n < len(self._saved) and self._saved[n]:
            n += 1
        if n > self._saved_prefix:
            self._saved_prefix = n
            self.sender.layers_done(self.forward, n)

    def wait_for_save(self) -> None:
        """The forward ended: every layer's KV is written."""
        if self._pushing:
            self._pushing = False
            self.sender.forward_done(self.forward, len(self.layer_index))

    def wait_for_results(self, timeout_s: float) -> bool:
        """Block until the writer or receiver has a result to report, at most ``timeout_s``.

        Called on a step that runs no model: the engine steps again at once after it,
        and at TP > 1 such back-to-back steps spin every worker (docs/connector-tp.md, "TP > 1 on a busy CPU")."""
        self.results_ready.clear()  # before looking: a result that comes after the look sets it again
        parts = [p for p in (self.sender, self.receiver) if p is not None]
        if any(p.has_results() for p in parts):
            return True
        return self.results_ready.wait(timeout_s)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(P requests whose blocks may be freed, D requests released, of which failed)."""
        sending = self.sender.take_finished() if self.sender else set()
        released, failed = self.receiver.take() if self.receiver else (set(), set())
        return sending, released, failed

    def shutdown(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
        self.trace.close()
