"""Part 1, our side: memory-server's in-process Runtime with the same workload as mem0_side.py."""

import argparse
import contextlib
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench.compare import measure
from bench.workload import write_result


class ServiceSide:
    modes = ["hybrid", "dense"]

    def __init__(self, data_dir: Path):
        from memory_server.auth import Principal
        from memory_server.config import Settings
        from memory_server.runtime import Runtime

        # No query-embedding cache: mem0 has none, and the benchmark's queries repeat.
        self.rt = Runtime.open(Settings(data_dir=data_dir, query_cache_size=0))
        self.principal = Principal(tenant_id="bench", key_id="bench", role="admin")
        self.events = {}

    def describe(self):
        from importlib.metadata import version
        names = ("memory-server", "qdrant-edge-py", "sentence-transformers", "torch")
        return {"versions": {p: version(p) for p in names},
                "notes": ["memory-server in-process Runtime (SQLite + Qdrant Edge in the data dir), no HTTP",
                          "query-embedding cache off (query_cache_size=0) so every search embeds its query, as mem0's does",
                          "fill beyond the measured adds: add_batch, 1,000 items a call (the normal API)"]}

    def _count(self, response):
        for r in response.results:
            self.events[r.event] = self.events.get(r.event, 0) + 1

    def add_one(self, user, text):
        from memory_server.schemas import AddRequest
        self._count(self.rt.memories.add(self.principal, AddRequest(text=text, user_id=user)))

    def add_batch(self, items):
        from memory_server.schemas import AddRequest
        reqs = [AddRequest(text=t, user_id=u) for u, t in items]
        self._count(self.rt.memories.add_batch(self.principal, reqs))

    def add_groups(self, groups):
        items = [(u, t) for u, texts in groups for t in texts]
        for i in range(0, len(items), 1000):
            self.add_batch(items[i:i + 1000])
        return (len(items) + 999) // 1000

    def fill(self, items, chunk=1000):
        for i in tqdm(range(0, len(items), chunk), desc=f"ours: fill {len(items)} via add_batch", unit="chunk"):
            self.add_batch(items[i:i + chunk])

    def search(self, user, query, mode):
        from memory_server.schemas import SearchRequest
        req = SearchRequest(query=query, filters={"user_id": user}, top_k=10, mode=mode)
        found = self.rt.memories.search(self.principal, req)
        return len(getattr(found, "results", found))

    def close(self):
        self.rt.close()


@contextlib.contextmanager
def temporary_side(prefix: str):
    """A ServiceSide on a fresh data directory, closed and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        side = ServiceSide(Path(tmp))
        try:
            yield side
        finally:
            side.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--batch-groups", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=120.0, help="search time cap per size and mode")
    p.add_argument("--out", default="service")
    a = p.parse_args(argv)
    with temporary_side("bench-service-") as side:
        result = measure(side, "ours", [int(s) for s in a.sizes.split(",")], a.batch_groups, a.queries,
                         max_seconds=a.max_seconds)
        result["add_events"] = side.events
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
