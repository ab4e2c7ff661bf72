"""Prometheus metrics, one registry per app (tests build many apps in one process)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
STAGE_BUCKETS = (0.0005, 0.001, *LATENCY_BUCKETS)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memory_server_http_requests_total", "HTTP requests",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("memory_server_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry, buckets=LATENCY_BUCKETS)
        # The Server-Timing stages (memory_server/timing.py): a growing `queue` says the workers'
        # request threads are all busy (more workers or cores help); `embed`, the model is.
        self.stages = Histogram("memory_server_http_request_stage_seconds",
                                "Time HTTP requests spent in each stage (the Server-Timing header's stages)",
                                ["route", "stage"], registry=self.registry, buckets=STAGE_BUCKETS)
        self.index_position = Gauge("memory_server_index_applied_position",
                                    "Last change-log position applied to the vector index", registry=self.registry)
        self.index_points = Gauge("memory_server_index_points", "Points in the vector index", registry=self.registry)
        self.index_left_out = Gauge("memory_server_index_left_out",
                                    "Memories the vector index cannot hold, left out of it (and of search) "
                                    "until changed; the log names them", registry=self.registry)
