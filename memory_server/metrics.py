"""Prometheus metrics, one registry per app (tests build many apps in one process)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
STAGE_BUCKETS = (0.0005, 0.001, *LATENCY_BUCKETS)


class Children:
    """A labelled metric's children by their label values, each looked up in the metric once.
    prometheus_client's `labels()` checks the values, joins them into a key and takes a lock on
    every call (1.8–3.5 µs by processor; a request makes ~7 such calls). The children live as long
    as the metric (nothing here removes one), so handing out the same child again is what
    `labels()` does too.
    The label values must come from a bounded set: a route template, a status, a stage's name."""

    def __init__(self, metric) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def __call__(self, *values: str):
        child = self._children.get(values)
        if child is None:  # two threads may both ask the metric: it gives both the same child
            child = self._children[values] = self.metric.labels(*values)
        return child


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
        self.request_count, self.request_latency, self.stage_latency = (
            Children(self.requests), Children(self.latency), Children(self.stages))
        self.index_position = Gauge("memory_server_index_applied_position",
                                    "Last change-log position applied to the vector index", registry=self.registry)
        self.index_points = Gauge("memory_server_index_points", "Points in the vector index", registry=self.registry)
        self.index_left_out = Gauge("memory_server_index_left_out",
                                    "Memories the vector index cannot hold, left out of it (and of search) "
                                    "until changed; the log names them", registry=self.registry)
