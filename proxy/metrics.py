"""The proxy's Prometheus metrics (own registry: several apps may live in one process).

Under ``kvpath proxy --workers N`` (proxy/tier.py) prometheus-client runs in its
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): every worker's values go to files in
one directory and a scrape of any worker sums them (in-flight gauges summed over the
live workers; healthy instances: the fewest any live worker has in rotation)."""

from __future__ import annotations

import glob
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def multiprocess() -> bool:
    """prometheus-client keeps its values in files (it decides so on this variable)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpath_proxy_requests_total", "requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvpath_proxy_errors_total", "errors by kind", ["kind"], registry=r)
        self.e2e = Histogram("kvpath_proxy_e2e_seconds", "request latency through the proxy",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("kvpath_proxy_first_token_seconds", "time to the first byte of D's response",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.healthy = Gauge("kvpath_proxy_healthy_instances", "instances in rotation (passing health checks) per role",
                             ["role"], registry=r, multiprocess_mode="livemin")
        self.inflight = Gauge("kvpath_proxy_inflight", "requests in flight per instance", ["role", "url"], registry=r,
                              multiprocess_mode="livesum")
        self.reservation = Histogram("kvpath_proxy_reservation_seconds", "time to get a lane from the reservation service",
                                     buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self._inflight_of: dict[tuple[str, str], Any] = {}
        self.fallbacks = Counter("kvpath_proxy_reservation_fallbacks_total",
                                 "requests that went on the hash-chosen lane, by reason", ["reason"], registry=r)

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's registry, or every worker's values."""
        if not multiprocess():
            return generate_latest(self.registry)
        from prometheus_client import multiprocess as mp

        _forget_dead_workers()
        reg = CollectorRegistry()
        mp.MultiProcessCollector(reg)
        return generate_latest(reg)

    def process_ended(self) -> None:
        """This worker's live gauges leave the sums (a worker that stops cleanly)."""
        if multiprocess():
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(os.getpid())

    def inflight_of(self, role: str, url: str) -> Any:
        """An instance's in-flight gauge (a child made once: ``labels()`` costs a lock and
        a lookup, twice per instance per request). Bounded by the instances ever added."""
        g = self._inflight_of.get((role, url))
        if g is None:
            g = self._inflight_of[(role, url)] = self.inflight.labels(role, url)
        return g


def _forget_dead_workers() -> None:
    """A worker that died without stopping (killed, crashed) leaves its live gauges'
    files; the collector does not check whether their process lives, so its last
    in-flight counts would stay in the sums: drop those of processes gone."""
    from prometheus_client import multiprocess as mp

    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        try:
            pid = int(f.rsplit("_", 1)[1][:-3])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            mp.mark_process_dead(pid, path)
        except PermissionError:
            continue  # alive, another user's
