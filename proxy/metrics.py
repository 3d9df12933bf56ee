"""The proxy's Prometheus metrics (own registry: several apps may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
                             ["role"], registry=r)
        self.inflight = Gauge("kvpath_proxy_inflight", "requests in flight per instance", ["role", "url"], registry=r)
        self.reservation = Histogram("kvpath_proxy_reservation_seconds", "time to get a lane from the reservation service",
                                     buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self.fallbacks = Counter("kvpath_proxy_reservation_fallbacks_total",
                                 "requests that went on the hash-chosen lane, by reason", ["reason"], registry=r)
