"""Runtime: the opened backends (SQL, embedder, vector index) and the services built on them."""

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from memory_server import allocator
from memory_server.auth import OPERATOR_TENANT, REVOCATIONS_FILE, KeyCache, create_key
from memory_server.config import Settings
from memory_server.embedding import Embedder
from memory_server.errors import StartupError
from memory_server.models import ApiKey
from memory_server.services.index_sync import IndexSync
from memory_server.services.vector_memory import VectorMemory
from memory_server.storage.db import (
    HeadHint, WalCheckpointer, begin_write, create_schema, make_engine, ping, warm_sqlite_file,
)
from memory_server.storage.vectors import VectorIndex
from memory_server.storage.vectors.sparse import SparseEncoder
from memory_server.timing import name_os_thread

log = logging.getLogger("memory_server")
BOOTSTRAP_KEY_FILE = "bootstrap-admin.key"
BOOTSTRAP_TENANT = OPERATOR_TENANT


def open_index(settings: Settings, dimension: int, model: str, *, recreate: bool = False) -> VectorIndex:
    if settings.qdrant_url:
        from qdrant_client import QdrantClient

        from memory_server.storage.vectors.qdrant import QdrantServerIndex

        client = QdrantClient(location=":memory:") if settings.qdrant_url == ":memory:" else \
            QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key)
        return QdrantServerIndex(client, settings.qdrant_collection, dimension, model, recreate=recreate)
    from memory_server.storage.vectors.edge import EdgeIndex, claim_shard_dir

    # Recreating is reindex: it rebuilds index/, the index every server opens first (see claim_shard_dir).
    path, hold = claim_shard_dir(settings.data_dir, primary=recreate)
    return EdgeIndex(path, dimension, model, recreate=recreate, hold=hold,
                     search_threads=settings.index_search_threads or None)


def open_database(settings: Settings) -> Engine:
    # Only its owner may enter a new data directory: the database in it holds every tenant's memories.
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)
    create_schema(engine)
    return engine


def ensure_bootstrap_key(engine: Engine, data_dir: Path) -> Path | None:
    """On an empty key table, create an admin key and write it to a 0600 file (never to the log).
    Checked under the database's write lock: replicas starting at once on a new database make one."""
    with Session(engine) as session:
        begin_write(session.connection())
        if session.exec(select(ApiKey.id).limit(1)).first() is not None:
            return None
        _, plaintext = create_key(session, tenant_id=BOOTSTRAP_TENANT, role="admin", label="bootstrap")
    path = data_dir / BOOTSTRAP_KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(plaintext + "\n")
    os.chmod(path, 0o600)
    return path


def _rebuild_outdated(settings: Settings, index: VectorIndex, sync: IndexSync) -> None:
    """An index made by an earlier version (its points lack a payload field searches now use) is
    rebuilt from SQL before anything else touches it. An Edge index belongs to this process alone;
    a Qdrant server collection is shared by every replica, so there the operator rebuilds it once."""
    if settings.qdrant_url:
        index.close()
        raise StartupError(f"Qdrant collection '{settings.qdrant_collection}' was made by an earlier version of "
                           "memory-server; stop the replicas and run `memory-server reindex` once")
    log.warning("the vector index was made by an earlier version; rebuilding it from SQL (once; a large store "
                "takes a while)")
    done = sync.rebuild()
    log.warning("vector index rebuilt: %d memories", done)


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    embedder: Embedder
    index: VectorIndex
    sync: IndexSync
    memories: VectorMemory
    keys: KeyCache = field(default_factory=lambda: KeyCache(0))
    checkpointer: WalCheckpointer | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _worker: threading.Thread | None = None

    @classmethod
    def open(cls, settings: Settings, *, embedder: Embedder | None = None, background: bool = False,
             recreate_index: bool = False) -> "Runtime":
        """`recreate_index` starts from an empty index (reindex); otherwise the stored one is checked."""
        allocator.limit_arenas()
        engine = open_database(settings)
        embedder = embedder or Embedder(settings.embedding_model, backend=settings.embedding_backend,
                                        batch_size=settings.embedding_batch_size,
                                        cache_size=settings.query_cache_size, device=settings.embedding_device,
                                        model_dir=settings.resolved_model_dir,
                                        quantize=settings.embedding_quantize, threads=settings.embedding_threads,
                                        wait_ms=settings.embedding_wait_ms, gather_size=settings.embedding_gather_size)
        index = open_index(settings, embedder.dimension, embedder.name, recreate=recreate_index)
        if settings.warm_database:  # after the index has read its own files (see warm_sqlite_file)
            warm_sqlite_file(engine)
        sparse = SparseEncoder()
        sync = IndexSync(engine, index, sparse, row_cache_bytes=int(settings.row_cache_mb * 1024 * 1024),
                         hint=HeadHint.beside(engine))
        if index.outdated and not recreate_index:
            _rebuild_outdated(settings, index, sync)
        if not recreate_index:
            sync.catch_up()  # repair: replay whatever SQL committed that the index has not applied
        if sync.left_out:
            log.error("%d memories are left out of the vector index (and of search): it could not hold them: %s; "
                      "they are indexed again when changed, or by `memory-server reindex` once it can hold them",
                      len(sync.left_out), ", ".join(sorted(sync.left_out)[:20]) + (" …" if len(sync.left_out) > 20 else ""))
        memories = VectorMemory(settings, engine, embedder, index, sync, sparse)
        checkpointer = (WalCheckpointer(engine) if settings.sqlite_background_checkpoints
                        and engine.dialect.name == "sqlite" else None)
        runtime = cls(settings, engine, embedder, index, sync, memories,
                      KeyCache(settings.key_cache_seconds, settings.data_dir / REVOCATIONS_FILE), checkpointer)
        if background:
            runtime.start_background()
        return runtime

    def start_background(self) -> None:
        self._worker = threading.Thread(target=self._maintain, name="memory-server-maintenance", daemon=True)
        self._worker.start()

    def _maintain(self) -> None:
        """Follow the change log (other replicas' writes), purge expired memories, optimize the index."""
        name_os_thread()
        since_sweep = 0.0
        interval = self.settings.sync_interval_seconds
        while not self._stop.wait(interval):
            try:
                self.sync.catch_up()
                since_sweep += interval
                if since_sweep >= self.settings.expiry_sweep_seconds:
                    since_sweep = 0.0
                    while self.memories.purge_expired():
                        pass
                if self._optimize_due():
                    self.sync.applied_since_optimize = 0
                    self.index.optimize()
            except Exception:  # keep maintaining; the next round retries
                log.exception("maintenance round failed")

    def _optimize_due(self) -> bool:
        """Whether to optimize the index now: once `index_optimize_every` changes were applied since
        the last time, as soon as no request has used the index for `index_optimize_idle_seconds`,
        and without waiting any longer once `index_optimize_deferred_max` were. Qdrant Edge holds
        the interpreter's lock through an optimisation (~1-3 s for 20k new points, more as segments
        merge), so every request of the process stands still meanwhile: under load, the slowest 1%
        of a 60-s run waited ~400 ms instead of ~110 (bench/analysis.md, round 34)."""
        settings = self.settings
        applied = self.sync.applied_since_optimize
        if applied < settings.index_optimize_every:
            return False
        quiet = time.monotonic() - self.memories.last_active >= settings.index_optimize_idle_seconds
        return quiet or applied >= max(settings.index_optimize_deferred_max, settings.index_optimize_every)

    def ready(self) -> dict:
        checks = {"database": ping(self.engine)}
        try:
            checks["model"] = self.embedder.embed_query("readiness probe").shape == (self.embedder.dimension,)
        except Exception:
            checks["model"] = False
        try:
            self.index.info()
            checks["index"] = True
        except Exception:
            checks["index"] = False
        return checks

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
        self.index.close()
        if self.sync.hint is not None:
            self.sync.hint.close()
        self.keys.close()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.engine.dispose()
