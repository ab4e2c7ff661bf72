"""Prometheus metrics, one registry per app (tests build many apps in one process)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memory_server_http_requests_total", "HTTP requests",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("memory_server_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry,
                                 buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
        self.index_position = Gauge("memory_server_index_applied_position",
                                    "Last change-log position applied to the vector index", registry=self.registry)
        self.index_points = Gauge("memory_server_index_points", "Points in the vector index", registry=self.registry)
