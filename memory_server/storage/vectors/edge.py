"""Qdrant Edge: the real Qdrant engine in-process, one shard in the data directory.

Each server process holds its own shard: the first free one of `index`, `index-1`, `index-2`, …
(a lock file next to each says which are taken). Worker processes of `serve --workers N`, or a
second server on the same data directory, therefore never share a shard; each follows the shared
change log, which keeps them all in step with the database.
"""

import fcntl
import shutil
import threading
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import qdrant_edge as qe

from memory_server import allocator
from memory_server.embedding import quantize_setting_for
from memory_server.errors import StartupError
from memory_server.storage.files import read_whole
from memory_server.storage.vectors import Hit, IndexInfo, IndexPoint, IndexQuery
from memory_server.storage.vectors.filters import Condition, Field, flatten

META_ID = "00000000-0000-0000-0000-000000000000"
KEYWORD_FIELDS = ("user_id", "agent_id", "run_id", "scope")
# What the points' payload holds; an index made with an older layout is rebuilt from SQL (see
# Runtime.open). 2: the "scope" keyword (services/index_sync.scope_key). 3: BM25 weights scaled by
# sparse.tie_break.
PAYLOAD_LAYOUT = 3
FLOAT_FIELDS = ("created_at", "updated_at", "expires_at")


MAX_SHARDS = 64
# What the config keeps Cold (memory-mapped, read on demand): the full dense vectors and the
# payloads. read_ahead leaves their files alone; every other file of a shard is read at load.
COLD_FILES = ("matrix.dat",)
COLD_DIRS = ("payload_storage",)
READ_AHEAD_THREADS = 4


def _slot_path(data_dir: Path, slot: int) -> Path:
    return data_dir / ("index" if slot == 0 else f"index-{slot}")


def _try_lock(path: Path) -> IO | None:
    handle = open(path.with_name(path.name + ".lock"), "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return handle
    except BlockingIOError:
        handle.close()
        return None


def claim_shard_dir(data_dir: Path, *, primary: bool = False) -> tuple[Path, IO]:
    """The first shard directory no other process (or open index) holds, and its held lock.

    `primary` (reindex): `index/` itself, and only while no process holds any shard: the next
    server opens `index/` first, and a server left running would go on answering from its own
    shard, so a rebuild anywhere else would look done and change nothing."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if primary:
        handle = _try_lock(_slot_path(data_dir, 0))
        held = [] if handle is not None else [_slot_path(data_dir, 0)]
        for slot in range(1, MAX_SHARDS):
            path = _slot_path(data_dir, slot)
            if path.with_name(path.name + ".lock").exists():  # a process made it; probing would make one
                probe = _try_lock(path)
                if probe is None:
                    held.append(path)
                else:
                    probe.close()
        if held:
            if handle is not None:
                handle.close()
            raise StartupError(f"the vector index {', '.join(p.name + '/' for p in held)} in {data_dir} is held by a "
                               "running process; stop every memory-server on this data directory first, then run "
                               "reindex again")
        return _slot_path(data_dir, 0), handle
    for slot in range(MAX_SHARDS):
        handle = _try_lock(_slot_path(data_dir, slot))
        if handle is not None:
            return _slot_path(data_dir, slot), handle
    raise StartupError(f"{MAX_SHARDS} processes already hold a vector index in {data_dir}")


def drop_unheld_shards(data_dir: Path, keep: Path) -> list[Path]:
    """Delete every other shard no process holds (after a reindex they describe the old index;
    a process that needs one again rebuilds it from the change log)."""
    dropped = []
    for slot in range(MAX_SHARDS):
        path = _slot_path(data_dir, slot)
        if path == keep or not path.exists():
            continue
        handle = _try_lock(path)
        if handle is not None:
            with handle:
                shutil.rmtree(path, ignore_errors=True)
                dropped.append(path)
    return dropped


class EdgeIndex:
    def __init__(self, path: Path, dimension: int, model: str, *, recreate: bool = False, hold: IO | None = None,
                 search_threads: int | None = 1):
        """`hold` is the shard directory's lock (from claim_shard_dir), released on close.
        `search_threads`: the shard's search pool (None: one per CPU)."""
        self.path = Path(path)
        self.search_threads = search_threads
        self.dimension = dimension
        self.model = model
        self._lock = threading.Lock()
        self._position = 0
        self._hold = hold
        # The earliest `expires_at` among the points (None: not known yet), kept as points come and
        # go, so that a search knows when no point can have expired (see may_hold_expired).
        self._expiry_lock = threading.Lock()
        self._earliest_expiry: float | None = None
        if recreate:
            shutil.rmtree(self.path, ignore_errors=True)
        try:
            self._shard = self._open()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._hold is not None:
            self._hold.close()  # closing the file releases the lock
            self._hold = None

    # -- lifecycle -------------------------------------------------------------------------
    def _config(self) -> qe.EdgeConfig:
        # Full vectors stay on disk (memory-mapped, read for rescoring); int8 copies live in RAM
        # for the search itself. That keeps 1M memories well under 2 GB of RSS.
        dense = qe.EdgeVectorParams(
            size=self.dimension, distance=qe.Distance.Cosine, memory=qe.Memory.Cold,
            quantization_config=qe.ScalarQuantizationConfig(type=qe.ScalarType.Int8, quantile=0.99,
                                                            memory=qe.Memory.Pinned),
        )
        return qe.EdgeConfig(
            vectors={"dense": dense},
            sparse_vectors={"bm25": qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf, memory=qe.Memory.Cached)},
            hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=10000, memory=qe.Memory.Cached),
            payload_memory=qe.Memory.Cold,
            id_tracker_memory=qe.Memory.Cached,
            # Segments stop growing at ~170k memories (the size counts full vectors: 1.5 KB each),
            # and up to 8 may stand side by side before small ones are merged. Without the cap every
            # optimisation merged new points into one ever larger segment: at 600k memories it took
            # ~20 s per 20k adds and halved the add rate; capped it stays ~3 s (docs/benchmarks.md).
            optimizers=qe.EdgeOptimizersConfig(default_segment_number=8, max_segment_size=256_000),
            # Our searches are filtered to one scope: a segment's part is ~0.1 ms, and handing the
            # parts of one search to a pool of threads doubled its CPU (0.23 vs 0.13 ms at 8
            # segments) for little less wall time. One thread leaves the cores to other requests.
            max_search_threads=self.search_threads,
        )

    def _open(self) -> qe.EdgeShard:
        if self.path.exists() and any(self.path.iterdir()):
            read_ahead(self.path)
            # The current config is applied to an existing shard too (segment sizes, search threads).
            try:
                shard = qe.EdgeShard.load(str(self.path), self._config())
            except Exception as exc:  # incompatible: say why (another model?) before anything else
                try:
                    shard = qe.EdgeShard.load(str(self.path))
                except Exception as damage:  # its files: cut short by a full disk, edited, half-copied
                    raise StartupError(f"vector index at {self.path} cannot be read ({damage}); it is derived from "
                                       "the database: `memory-server reindex` rebuilds it") from None
                refusal = StartupError(f"vector index at {self.path} does not fit the current settings ({exc}); "
                                       "run `memory-server reindex`")
            else:
                refusal = None
            meta = shard.retrieve([META_ID], True, False)
            if not meta:
                shard.close()
                raise StartupError(f"vector index at {self.path} has no metadata point; run `memory-server reindex`")
            payload = meta[0].payload or {}
            try:
                check_model(payload, self.dimension, self.model, f"vector index at {self.path}")
                if refusal is not None:
                    raise refusal
            except StartupError:
                shard.close()
                raise
            self._position = int(payload.get("position", 0))
            self.left_out = frozenset(payload.get("left_out", ()))
            self.outdated = int(payload.get("layout", 1)) < PAYLOAD_LAYOUT
            return shard
        self.path.mkdir(parents=True, exist_ok=True)
        shard = qe.EdgeShard.create(str(self.path), self._config())
        cached = qe.Memory.Cached
        shard.update(qe.UpdateOperation.create_field_index("tenant", qe.KeywordIndexParams(is_tenant=True, memory=cached)))
        for name in KEYWORD_FIELDS:
            shard.update(qe.UpdateOperation.create_field_index(name, qe.KeywordIndexParams(memory=cached)))
        for name in FLOAT_FIELDS:
            shard.update(qe.UpdateOperation.create_field_index(name, qe.FloatIndexParams(memory=cached)))
        self._position = 0
        self.left_out = frozenset()
        self.outdated = False
        shard.update(qe.UpdateOperation.upsert_points([self._meta_point(0)]))
        shard.flush()
        return shard

    def _meta_point(self, position: int) -> qe.Point:
        return qe.Point(META_ID, {}, meta_payload(self, position))

    def close(self) -> None:
        with self._lock:
            try:
                self._shard.flush()
                self._shard.close()
            finally:
                self._release()

    def reset(self) -> None:
        with self._lock, self._expiry_lock:
            self._shard.close()
            shutil.rmtree(self.path, ignore_errors=True)
            self._shard = self._open()
            self._earliest_expiry = None

    # -- writes ----------------------------------------------------------------------------
    def prepare(self, point: IndexPoint) -> IndexPoint:
        try:
            return replace(point, native=_edge_point(point))
        except Exception:  # the binding's conversion: see refused
            return point

    def upsert(self, points: list[IndexPoint]) -> None:
        if points:
            self._upsert(points)

    def _upsert(self, points: list[IndexPoint], *, position: int | None = None) -> None:
        """`points`, and the meta point recording `position` after them in the same update (one
        WAL entry: the position never lands without the points it covers)."""
        edge_points = [_edge_point(p) for p in points]
        if position is not None:
            edge_points.append(self._meta_point(position))
        # The earliest expiry is lowered before the points become searchable, and under the lock a
        # lookup takes, so that it never overwrites the lower value with an older answer. (A search
        # that read the value just before may still meet such a point: VectorMemory.search checks.)
        with self._expiry_lock:
            if self._earliest_expiry is not None and points:
                self._earliest_expiry = min(self._earliest_expiry, *(p.payload["expires_at"] for p in points))
            self._shard.update(qe.UpdateOperation.upsert_points(edge_points))

    def delete(self, ids: list[str]) -> None:
        if ids:
            # Each point is first written again without its keyword vector: a deleted point's terms
            # otherwise stay in the segment's BM25 document frequencies until it is reloaded, and the
            # process that deleted it ranked keyword and hybrid searches unlike a replica or a restart
            # did (bench/analysis.md, round 27).
            blank = [qe.Point(i, {"bm25": qe.SparseVector([], [])}, {}) for i in ids]
            self._shard.update(qe.UpdateOperation.upsert_points(blank))
            self._shard.update(qe.UpdateOperation.delete_points(list(ids)))

    def refused(self, points: list[IndexPoint]) -> list[str]:
        refused = []
        for p in points:
            try:
                _edge_point(p)
            except Exception:  # the binding's conversion: TypeError, ValueError, OverflowError
                refused.append(p.id)
        return refused

    def applied_position(self) -> int:
        return self._position

    def set_applied_position(self, position: int) -> None:
        # The meta point goes through the same WAL after the data it covers, so a crash
        # never leaves a position ahead of the points it claims.
        self.apply([], [], position)

    def apply(self, points: list[IndexPoint], deleted: list[str], position: int) -> None:
        # One update for the common run of entries (new or changed memories): ~0.1 ms less an add
        # than the points and the position written apart (bench/analysis.md, round 22).
        if deleted:
            self.upsert(points)
            self.delete(deleted)
            self.set_applied_position(position)
            return
        self._upsert(points, position=position)
        self._position = position

    def optimize(self) -> None:
        self._shard.optimize()
        # The segments an optimisation replaced stay on disk (and mapped) until the next flush:
        # without it, every optimisation of a growing index left its whole previous copy behind
        # (2.9 GB on disk for 100k memories instead of ~0.6 GB).
        self._shard.flush()
        # What the replaced segments and the optimisation itself held is free now; hand it back to
        # the system, or the process keeps its high-water mark (every caller wants this: the
        # maintenance thread, a rebuild, a bulk load).
        allocator.release_free_memory()

    # -- reads -----------------------------------------------------------------------------
    def may_hold_expired(self, now: float) -> bool:
        """Expired memories stay in the index until the expiry sweep deletes them, so a search
        filters on `expires_at > now`, a range check on every point of the scope: ~0.5 ms of a
        dense query for one user of ~950 memories at 1M (bench/analysis.md, round 10). Most stores
        hold no expired point most of the time; this says when. The earliest expiry is looked up
        again (a scroll ordered by `expires_at`: ~0.03 ms at 1M) only when it is unknown or has
        passed: the sweep may have deleted that point, or an update moved its expiry."""
        earliest = self._earliest_expiry
        if earliest is None or earliest <= now:
            with self._expiry_lock:
                earliest = self._earliest_expiry = self._first_expiry()
        return earliest <= now

    def _first_expiry(self) -> float:
        try:
            first, _ = self._shard.scroll(qe.ScrollRequest(limit=1, order_by=qe.OrderBy("expires_at"), with_payload=False))
        except Exception:  # cannot tell (no range index on expires_at?): keep the condition
            return float("-inf")
        return float(first[0].order_value) if first else float("inf")  # the meta point has no expires_at

    def search(self, query: IndexQuery) -> list[Hit]:
        request = self._request(query)
        return [] if request is None else _hits(self._shard.query(request))

    def search_batch(self, queries: list[IndexQuery]) -> list[list[Hit]]:
        requests = [self._request(query) for query in queries]
        runnable = [request for request in requests if request is not None]
        answers = iter(self._shard.query_batch(qe.QueryBatchRequest(runnable)) if runnable else [])
        return [[] if request is None else _hits(next(answers)) for request in requests]

    @staticmethod
    def _request(query: IndexQuery) -> qe.QueryRequest | None:
        """The Edge request for a query; None when it cannot match anything (a keyword query
        without searchable terms)."""
        flt = _filter(query.filter)
        if query.mode == "dense":
            return qe.QueryRequest(limit=query.limit, query=qe.Query.Nearest(query.dense, using="dense"), filter=flt,
                                   score_threshold=query.min_score)
        if query.mode == "keyword":
            if not query.sparse or not query.sparse.indices:
                return None
            sparse = qe.SparseVector(query.sparse.indices, query.sparse.values)
            return qe.QueryRequest(limit=query.limit, query=qe.Query.Nearest(sparse, using="bm25"), filter=flt)
        prefetches = [qe.Prefetch(limit=query.candidates, query=qe.Query.Nearest(query.dense, using="dense"), filter=flt)]
        weights = [query.weights[0]]
        if query.sparse and query.sparse.indices:
            sparse = qe.SparseVector(query.sparse.indices, query.sparse.values)
            prefetches.append(qe.Prefetch(limit=query.candidates, query=qe.Query.Nearest(sparse, using="bm25"), filter=flt))
            weights.append(query.weights[1])
        # No filter on the fusion itself: it only ranks what the filtered prefetches found, and a
        # filter there checked every candidate's payload again (~0.1 ms of a hybrid search at 10k
        # memories, the same answers: bench/analysis.md, round 23).
        return qe.QueryRequest(limit=query.limit, prefetches=prefetches, query=qe.Fusion.Rrf(k=query.rrf_k, weights=weights))

    def info(self) -> IndexInfo:
        info = self._shard.info()
        # info() estimates points across segments (old versions included); count() is exact.
        points = self._shard.count(qe.CountRequest(exact=True))
        return IndexInfo("qdrant-edge", self.dimension, max(0, points - 1), self._position,
                         {"segments": info.segments_count, "path": str(self.path)})


def warm_files(path: Path) -> list[Path]:
    """The files of a shard that loading it reads whole: everything but the Cold structures."""
    return [f for f in sorted(path.rglob("*"))
            if f.is_file() and f.name not in COLD_FILES and not any(d in f.parts for d in COLD_DIRS)]


def read_ahead(path: Path) -> int:
    """Read a shard's warm files sequentially, a few at a time, before Qdrant loads it; returns the bytes read.

    Loading copies the int8 vectors into RAM and pre-warms the HNSW graphs, id trackers and
    payload indexes, all through memory-mapped page faults, which read a cold disk a few pages at a
    time: at 1M memories, with nothing in the page cache (a server started after a reboot), the
    load took 8.7 s. Read first in large sequential reads, the same files (1.3 GB) took ~0.6-1.2 s
    and the load then 0.9 s. With the files already cached, this is a memory copy (~0.2 s at 1M)."""
    with ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="index-read-ahead") as pool:
        return sum(pool.map(read_whole, warm_files(path)))


def _hits(points) -> list[Hit]:
    return [Hit(str(p.id), float(p.score)) for p in points]


def meta_payload(index, position: int) -> dict:
    """The meta point's payload (both backends): the position applied, what made the index, and the
    memories left out of it."""
    payload = {"_meta": True, "position": position, "dimension": index.dimension, "model": index.model,
               "layout": PAYLOAD_LAYOUT}
    if index.left_out:
        payload["left_out"] = sorted(index.left_out)
    return payload


def check_model(meta: dict, dimension: int, model: str, where: str) -> None:
    """Refuse to mix vectors of two models: a clear startup error, never silent corruption."""
    stored_dim, stored_model = int(meta.get("dimension", -1)), meta.get("model")
    if stored_dim != dimension or stored_model != model:
        setting = quantize_setting_for(str(stored_model), model)
        old = f"MEMORY_SERVER_EMBEDDING_QUANTIZE={setting}" if setting else "the old model"
        raise StartupError(
            f"{where} holds {stored_dim}-dimensional vectors of model '{stored_model}', but the configured "
            f"embedding model '{model}' makes {dimension}-dimensional ones; start with {old}, or run "
            "`memory-server reindex --reembed` to re-embed every memory with the new one"
        )


def _filter(node: Condition) -> qe.Filter:
    must, should, must_not = flatten(node)  # each filter nested in another costs the binding ~8 leaves
    return qe.Filter(must=[_translate(item) for item in must] or None,
                     should=None if should is None else [_translate(item) for item in should],
                     must_not=[_translate(item) for item in must_not] or None)


def _translate(node: Condition):
    return _field(node) if isinstance(node, Field) else _filter(node)


def _field(leaf: Field):
    key, op, value = leaf.key, leaf.op, leaf.value
    if op == "eq":
        if isinstance(value, float):
            return qe.FieldCondition(key, range=qe.RangeFloat(gte=value, lte=value))
        return qe.FieldCondition(key, match=qe.MatchValue(value))
    if op == "in":
        return qe.FieldCondition(key, match=qe.MatchAny(list(value)))
    if op == "substring":
        return qe.FieldCondition(key, match=qe.MatchSubstring(value))
    return qe.FieldCondition(key, range=qe.RangeFloat(**{op: value}))


def _edge_point(p: IndexPoint) -> qe.Point:
    if p.native is not None:  # prepared ahead (EdgeIndex.prepare)
        return p.native
    return qe.Point(p.id, {"dense": p.dense, "bm25": qe.SparseVector(p.sparse.indices, p.sparse.values)}, p.payload)
