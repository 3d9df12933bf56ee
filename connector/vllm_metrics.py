"""Transfer metrics into vLLM's logging and its Prometheus ``/metrics``."""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpath.connector.telemetry import COUNTERS, StatsWindow


def window_to_data(w: StatsWindow) -> dict[str, Any]:
    return {"counters": dict(w.counters), "transfer_s": list(w.transfer_s), "bytes": list(w.bytes),
            "descriptors": list(w.descriptors)}


class KVPathStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "transfer_s": [], "bytes": [], "descriptors": []}

    def aggregate(self, other: KVConnectorStats) -> "KVPathStats":
        o = other.data
        for k, v in o.get("counters", {}).items():
            self.data["counters"][k] = self.data["counters"].get(k, 0) + v
        for k in ("transfer_s", "bytes", "descriptors"):
            self.data[k] = list(self.data[k]) + list(o.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        t = self.data["transfer_s"]
        if t:
            out["push_mean_ms"] = round(float(np.mean(t)) * 1e3, 3)
            out["push_p99_ms"] = round(float(np.percentile(t, 99)) * 1e3, 3)
            out["push_MBps"] = round(sum(self.data["bytes"]) / max(sum(t), 1e-9) / 1e6, 1)
            out["descs_mean"] = round(float(np.mean(self.data["descriptors"])), 1)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["transfer_s"]


class KVPathPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name in COUNTERS:
            c = self._counter_cls(
                name=f"vllm:kvpath_{name}", documentation=f"kvpath connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self.counters[name] = create_metric_per_engine(c, per_engine_labelvalues)
        h = self._histogram_cls(
            name="vllm:kvpath_push_seconds", documentation="kvpath: time from posting a push to its completion",
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0], labelnames=labelnames,
        )
        self.h_time = create_metric_per_engine(h, per_engine_labelvalues)
        h = self._histogram_cls(
            name="vllm:kvpath_push_bytes", documentation="kvpath: bytes per push",
            buckets=[2 ** (10 + 2 * i) for i in range(12)], labelnames=labelnames,
        )
        self.h_bytes = create_metric_per_engine(h, per_engine_labelvalues)
        h = self._histogram_cls(
            name="vllm:kvpath_push_descriptors", documentation="kvpath: NIXL descriptors per push",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096], labelnames=labelnames,
        )
        self.h_descs = create_metric_per_engine(h, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.get("counters", {}).items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
        for v in transfer_stats_data.get("transfer_s", []):
            self.h_time[engine_idx].observe(v)
        for v in transfer_stats_data.get("bytes", []):
            self.h_bytes[engine_idx].observe(v)
        for v in transfer_stats_data.get("descriptors", []):
            self.h_descs[engine_idx].observe(v)
