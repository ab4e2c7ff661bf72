"""Keeps a vector index in step with the SQL change log: ordered, idempotent, resumable."""

import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
from sqlalchemy import bindparam, func
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from memory_server.errors import StartupError
from memory_server.models import ChangeLogEntry, MemoryRecord, embedding_input
from memory_server.services.filters import NEVER
from memory_server.storage.db import driver_rows
from memory_server.storage.vectors import IndexPoint, VectorIndex
from memory_server.storage.vectors.sparse import SparseEncoder


def payload_metadata(value):
    """Booleans are indexed as 1/0: Qdrant Edge's Python binding turns a bool match into an integer
    one, so both backends store and match booleans as integers (and filters convert likewise)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, dict):
        return {k: payload_metadata(v) for k, v in value.items()}
    if isinstance(value, list):
        return [payload_metadata(v) for v in value]
    return value


def scope_key(tenant_id: str, user_id: str | None, agent_id: str | None, run_id: str | None) -> str:
    """One keyword for a memory's exact scope: "tenant/user/agent/run", "" for an id not set (ids
    never hold "/"). The near-duplicate check looks a new memory's scope up by it: one filter
    condition instead of four, ~40% less per query at 200k memories (bench/analysis.md, round 5)."""
    return f"{tenant_id}/{user_id or ''}/{agent_id or ''}/{run_id or ''}"


def point_for(row: MemoryRecord, sparse: SparseEncoder) -> IndexPoint:
    payload = {
        "tenant": row.tenant_id,
        "scope": scope_key(row.tenant_id, row.user_id, row.agent_id, row.run_id),
        # "" stands for "not set": scope ids are never empty, and a keyword match stays exact.
        "user_id": row.user_id or "",
        "agent_id": row.agent_id or "",
        "run_id": row.run_id or "",
        "created_at": row.created_at.timestamp(),
        "updated_at": row.updated_at.timestamp(),
        "expires_at": row.expires_at.timestamp() if row.expires_at else NEVER,
        "metadata": payload_metadata(row.meta),
    }
    dense = np.frombuffer(row.embedding, dtype=np.float32).tolist()
    return IndexPoint(row.id, dense, sparse.document(row.text), payload)


POINT_COLUMNS = (MemoryRecord.id, MemoryRecord.tenant_id, MemoryRecord.user_id, MemoryRecord.agent_id,
                 MemoryRecord.run_id, MemoryRecord.text, col(MemoryRecord.meta).label("meta"), MemoryRecord.embedding,
                 MemoryRecord.created_at, MemoryRecord.updated_at, MemoryRecord.expires_at)


_HEAD = f"SELECT max(position) FROM {ChangeLogEntry.__tablename__}"
_ENTRIES = (select(ChangeLogEntry.position, ChangeLogEntry.memory_id)
            .where(ChangeLogEntry.position > bindparam("after")).order_by(ChangeLogEntry.position)
            .limit(bindparam("limit")))
_POINT_ROWS = select(*POINT_COLUMNS).where(col(MemoryRecord.id).in_(bindparam("ids", expanding=True)))


class IndexSync:
    """Applies change-log entries after the index's recorded position, in order."""

    def __init__(self, engine: Engine, index: VectorIndex, sparse: SparseEncoder, batch_size: int = 1000):
        self.engine = engine
        self.index = index
        self.sparse = sparse
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self.applied_since_optimize = 0

    def head(self) -> int:
        # The driver's cursor on a plain connection: every search asks this first (storage/db.py).
        with self.engine.connect() as connection:
            return driver_rows(connection, _HEAD)[0][0] or 0

    def follow(self) -> None:
        """Apply what other processes (workers, replicas) committed, if anything: a search then
        sees every write that was answered before it began, whichever process took the write."""
        if self.head() > self.index.applied_position():
            self.catch_up()

    def catch_up(self, prepared: dict[str, IndexPoint] | None = None) -> int:
        """Apply everything committed so far; returns how many entries were applied. `prepared`:
        points a writer built from the rows it has just committed (see _apply)."""
        applied = 0
        with self._lock:
            while True:
                position = self.index.applied_position()
                with self.engine.connect() as connection:
                    entries = connection.execute(_ENTRIES, {"after": position, "limit": self.batch_size}).all()
                    if not entries:
                        return applied
                    self._apply(connection, [memory_id for _, memory_id in entries], prepared or {})
                self.index.set_applied_position(entries[-1][0])
                applied += len(entries)
                self.applied_since_optimize += len(entries)

    def _apply(self, connection: Connection, memory_ids: list[str], prepared: dict[str, IndexPoint]) -> None:
        # Entries only name what changed; the row as it is now is the truth. A row that is gone
        # is deleted from the index, so replay can never resurrect a deleted memory.
        counts = Counter(memory_ids)
        wanted = list(counts)
        # A batch add builds its new memories' points while the model is still embedding, and its
        # apply skips reading them back: a new memory's one entry is that add's own, so its row is
        # as the add wrote it. Any later change has an entry of its own, applied after this one.
        ready = {i: prepared[i] for i in wanted if counts[i] == 1 and i in prepared}
        # Plain rows of the columns a point needs: building ORM objects cost more than the index upsert.
        read = [i for i in wanted if i not in ready]
        rows = {r.id: r for r in connection.execute(_POINT_ROWS, {"ids": read})} if read else {}
        self.index.upsert([ready[i] if i in ready else point_for(rows[i], self.sparse)
                           for i in wanted if i in ready or i in rows])
        self.index.delete([i for i in read if i not in rows])

    def rebuild(self, progress: Callable[[int, int], None] | None = None, *, reembed=None) -> int:
        """Rebuild the index from SQL alone. Stored embeddings are used as they are, unless `reembed`
        (an Embedder) is given: then every memory is embedded again and its stored vector replaced."""
        with self._lock:
            head = self.head()
            self.index.reset()
            with Session(self.engine) as session:
                total = session.exec(select(func.count()).select_from(MemoryRecord)).one()
                done, last_id = 0, ""
                while True:
                    rows = session.exec(
                        select(MemoryRecord).where(MemoryRecord.id > last_id).order_by(MemoryRecord.id).limit(self.batch_size)
                    ).all()
                    if not rows:
                        break
                    if reembed is not None:
                        inputs = [embedding_input(row.text, row.context) for row in rows]
                        for row, vector in zip(rows, reembed.embed(inputs)):
                            row.embedding = vector.tobytes()
                            session.add(row)
                        session.commit()
                    elif len(rows[0].embedding) != 4 * self.index.dimension:
                        raise StartupError(
                            f"stored embeddings have {len(rows[0].embedding) // 4} dimensions, the configured model "
                            f"makes {self.index.dimension}; run `memory-server reindex --reembed`")
                    self.index.upsert([point_for(row, self.sparse) for row in rows])
                    done, last_id = done + len(rows), rows[-1].id
                    session.expunge_all()
                    if progress:
                        progress(done, total)
            # Anything committed after `head` is replayed on top by the next catch_up.
            self.index.set_applied_position(head)
            self.index.optimize()
            self.applied_since_optimize = 0
            return done
