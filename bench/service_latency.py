"""Part 2: in-process service latency (no HTTP) at growing sizes in the embedded default.

Search p50/p95 split into query embedding, index (Qdrant Edge) and the rest (SQL rows, response);
batch add throughput; RSS, disk and reopen time at each size (the 1M point is the RSS/disk target).
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from bench.workload import iter_memories, machine, percentiles, queries, write_result


def rss_mb() -> float:
    return memory_mb()["rss_mb"]


def memory_mb() -> dict:
    """VmRSS and its parts: anonymous memory (heap) and file pages (memory-mapped index files and
    model, which the kernel can drop and re-read under memory pressure)."""
    names = {"VmRSS:": "rss_mb", "RssAnon:": "anon_mb", "RssFile:": "file_mb"}
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split()[0]
            if key in names:
                out[names[key]] = round(int(line.split()[1]) / 1024, 1)
    return out or {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


_REOPEN = """
import json, sys, time
from pathlib import Path
from bench.service_latency import memory_mb
from bench.workload import percentiles, queries
from memory_server.auth import Principal
from memory_server.config import Settings
from memory_server.runtime import Runtime
from memory_server.schemas import SearchRequest
settings = Settings(data_dir=Path(sys.argv[1]), query_cache_size=0)
started = time.perf_counter()
rt = Runtime.open(settings)
opened = time.perf_counter() - started
principal = Principal(tenant_id="bench", key_id="bench", role="admin")
timed = {}
for name, seed in (("first_searches", 5), ("next_searches", 6)):
    took = []
    for user, query in queries(200, seed=seed):
        t = time.perf_counter()
        rt.memories.search(principal, SearchRequest(query=query, filters={"user_id": user}))
        took.append(time.perf_counter() - t)
    timed[name] = percentiles(took)
print(json.dumps({"reopen_s": round(opened, 2), **memory_mb(), **timed}))
rt.close()
"""


def reopen_in_fresh_process(data_dir: Path) -> dict:
    """What a restarted server holds: open the store in a new process, run 2 x 200 hybrid searches
    (timed: the first ones after a start find less of the index in memory), read RSS."""
    done = subprocess.run([sys.executable, "-c", _REOPEN, str(data_dir)], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parent.parent)
    return json.loads(done.stdout.strip().splitlines()[-1])


def disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def measure_size(rt, principal, n_queries: int) -> dict:
    from memory_server.schemas import SearchRequest
    from memory_server.services.filters import restrict
    from memory_server.storage.vectors import IndexQuery
    from memory_server.storage.vectors.filters import All, Field

    settings = rt.settings
    out = {}
    for mode in ("hybrid", "dense", "keyword"):
        embed_s, index_s, total_s = [], [], []
        for user, query in queries(n_queries):
            started = time.perf_counter()
            rt.memories.search(principal, SearchRequest(query=query, filters={"user_id": user}, mode=mode))
            total_s.append(time.perf_counter() - started)
            # The same search, its parts timed alone.
            t0 = time.perf_counter()
            dense = rt.embedder.embed([query])[0].tolist() if mode != "keyword" else None
            t1 = time.perf_counter()
            flt = restrict(principal, All((Field("user_id", "eq", user),)))
            rt.index.search(IndexQuery(mode=mode, filter=flt, limit=18, dense=dense,
                                       sparse=rt.memories.sparse.query(query) if mode != "dense" else None,
                                       candidates=settings.search_candidates, rrf_k=settings.rrf_k,
                                       weights=(settings.hybrid_dense_weight, settings.hybrid_keyword_weight)))
            t2 = time.perf_counter()
            embed_s.append(t1 - t0)
            index_s.append(t2 - t1)
        out[mode] = {"total": percentiles(total_s), "embedding": percentiles(embed_s), "index": percentiles(index_s)}
    return out


def measure_point(rt, principal, data_dir: Path, n_queries: int) -> dict:
    """Searches, RSS and disk of the open store; then closes it and reopens it in a fresh process."""
    point = {"search": measure_size(rt, principal, n_queries), "memory_filling_process": memory_mb()}
    point["rss_mb"] = point["memory_filling_process"]["rss_mb"]
    point["disk_mb"] = round(disk_mb(data_dir), 1)
    rt.close()
    fresh = reopen_in_fresh_process(data_dir)
    point["reopen_s"] = fresh.pop("reopen_s")
    point["memory_after_reopen"] = fresh
    point["rss_after_reopen_mb"] = fresh["rss_mb"]
    return point


def measure_kept(data_dir: Path, out: str, n_queries: int) -> None:
    """--measure: time the searches, RSS, disk and reopen of a store an earlier --keep run filled
    (say after a change to the search path), without filling again."""
    from sqlalchemy import func, select

    from memory_server.auth import Principal
    from memory_server.config import Settings
    from memory_server.models import MemoryRecord
    from memory_server.runtime import Runtime

    principal = Principal(tenant_id="bench", key_id="bench", role="admin")
    rt = Runtime.open(Settings(data_dir=data_dir, query_cache_size=0), background=True)
    with rt.engine.connect() as connection:
        size = connection.execute(select(func.count()).select_from(MemoryRecord)).scalar()
    result = {"machine": machine(), "notes": [f"an existing store ({data_dir}) measured again, not filled"],
              "sizes": {str(size): measure_point(rt, principal, data_dir, n_queries)}}
    print(write_result(out, result))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--out", default="service-latency")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="fill the store in DIR (new or empty) and keep it afterwards, e.g. to profile search or "
                        "reopen at 1M without another fill (default: a temporary directory, removed)")
    p.add_argument("--measure", type=Path, metavar="DIR",
                   help="measure the store in DIR (filled by an earlier --keep run) again instead of filling one")
    a = p.parse_args(argv)
    if a.measure is not None:
        if not (a.measure / "index").is_dir():
            p.error(f"--measure {a.measure}: not a data directory filled by --keep")
        return measure_kept(a.measure, a.out, a.queries)
    if a.keep is not None and a.keep.exists() and any(a.keep.iterdir()):
        p.error(f"--keep {a.keep}: the directory is not empty")

    from memory_server.auth import Principal
    from memory_server.config import Settings
    from memory_server.runtime import Runtime
    from memory_server.schemas import AddRequest

    sizes = sorted(int(s) for s in a.sizes.split(","))
    principal = Principal(tenant_id="bench", key_id="bench", role="admin")
    tmp = a.keep or Path(tempfile.mkdtemp(prefix="bench-latency-"))
    tmp.mkdir(parents=True, exist_ok=True)
    settings = Settings(data_dir=tmp, query_cache_size=0)  # MEMORY_SERVER_* from the environment apply
    result = {"machine": machine(), "sizes": {}, "notes": [
        "in-process Runtime with its maintenance thread (as in the server): SQLite + Qdrant Edge (int8 quantised "
        "vectors in RAM; full vectors, HNSW graph, sparse and payload indexes memory-mapped), int8 ONNX embedding",
        "restarted process: the store opened in a new process after 400 searches (what a restarted server holds); "
        "file pages are memory-mapped index and model files, which the kernel can drop under memory pressure",
        "query-embedding cache off: every search embeds its query",
        "embedding/index: the same query's parts timed alone; total includes SQL row fetch and scoring",
    ]}
    try:
        # With the maintenance thread, as in the server. A fill leaves it no quiet moment, so it
        # optimises the index every MEMORY_SERVER_INDEX_OPTIMIZE_DEFERRED_MAX applied changes
        # (runtime.py _optimize_due); each size ends with an optimisation of what is left.
        rt = Runtime.open(settings, background=True)
        data = iter_memories(sizes[-1], seed=3)  # one chunk at a time: the list would be RSS of its own
        loaded, add_seconds = 0, 0.0
        for size in sizes:
            bar = tqdm(total=size - loaded, desc=f"fill to {size}", unit="mem")
            while loaded < size:
                chunk = [AddRequest(text=t, user_id=u) for u, t in islice(data, min(size - loaded, 1000))]
                started = time.perf_counter()
                rt.memories.add_batch(principal, chunk)
                add_seconds += time.perf_counter() - started
                loaded += len(chunk)
                bar.update(len(chunk))
            bar.close()
            started = time.perf_counter()
            rt.index.optimize()
            optimize_s = time.perf_counter() - started
            point = {"batch_add_per_s": round(loaded / add_seconds, 1), "optimize_s": round(optimize_s, 1),
                     **measure_point(rt, principal, tmp, a.queries)}
            rt = Runtime.open(settings, background=True)
            result["sizes"][str(size)] = point
            write_result(a.out, result)  # after every size, so a long 1M run keeps the smaller points
            print(size, {k: v for k, v in point.items() if k != "search"},
                  {m: round(v["total"]["p95_ms"], 2) for m, v in point["search"].items()})
        rt.close()
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(write_result(a.out, result))


if __name__ == "__main__":
    main()
