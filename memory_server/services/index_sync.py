"""Keeps a vector index in step with the SQL change log: ordered, idempotent, resumable."""

import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from sqlalchemy import func
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, select

from memory_server.errors import StartupError
from memory_server.models import ChangeLogEntry, MemoryRecord, embedding_input
from memory_server.services.filters import NEVER
from memory_server.storage.db import HeadHint, driver_rows, placeholders, stored_json, stored_time
from memory_server.storage.vectors import IndexPoint, VectorIndex
from memory_server.storage.vectors.sparse import SparseEncoder

log = logging.getLogger("memory_server")


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


class PointRow(NamedTuple):
    """The columns a point is built from, as the driver gives them (storage/db.py: stored_time, stored_json)."""
    id: str
    tenant_id: str
    user_id: str | None
    agent_id: str | None
    run_id: str | None
    text: str
    meta: object
    embedding: bytes
    created_at: object
    updated_at: object
    expires_at: object


def point_for(row: MemoryRecord | PointRow, sparse: SparseEncoder) -> IndexPoint:
    expires_at = stored_time(row.expires_at)
    payload = {
        "tenant": row.tenant_id,
        "scope": scope_key(row.tenant_id, row.user_id, row.agent_id, row.run_id),
        # "" stands for "not set": scope ids are never empty, and a keyword match stays exact.
        "user_id": row.user_id or "",
        "agent_id": row.agent_id or "",
        "run_id": row.run_id or "",
        "created_at": stored_time(row.created_at).timestamp(),
        "updated_at": stored_time(row.updated_at).timestamp(),
        "expires_at": expires_at.timestamp() if expires_at else NEVER,
        "metadata": payload_metadata(stored_json(row.meta)),
    }
    dense = np.frombuffer(row.embedding, dtype=np.float32).tolist()
    return IndexPoint(row.id, dense, sparse.document(row.text, row.id), payload)


# Plain SQL on the driver's cursor (storage/db.py driver_rows): a follower runs these for every
# change another process made, SQLAlchemy's execution path cost more than SQLite's answer.
_HEAD = f"SELECT max(position) FROM {ChangeLogEntry.__tablename__}"
_ENTRIES = f"SELECT position, memory_id, op FROM {ChangeLogEntry.__tablename__} WHERE position > {{0}} ORDER BY position LIMIT {{0}}"
# The id list (placeholders) is added when it runs.
_POINT_ROWS = ("SELECT id, tenant_id, user_id, agent_id, run_id, text, metadata, embedding, created_at, updated_at, "
               f"expires_at FROM {MemoryRecord.__tablename__} WHERE id IN ")


def change_log_head(connection: Connection) -> int:
    """The position of the last committed change (0: none yet); any write moves it."""
    return driver_rows(connection, _HEAD)[0][0] or 0


class RowCache:
    """Rows of memories as the driver gave them (a search's hits: VectorMemory._answer), kept in
    step with the change log as the index is: IndexSync forgets a memory's row before it applies
    an entry of it, so a search that followed the log (every search does) never gets a row older
    than what the index answered it from. A search's hits cost ~0.2 ms of CPU to read from SQLite
    on a Zen 5 under load, a third of the request thread's part of a search, ~0.025 ms from here
    (bench/analysis.md, round 35): SQLite drops a connection's page cache whenever another
    connection wrote, which under a steady stream of adds is nearly every time.

    Least recently used rows go first past `max_bytes` (a row counts the characters of its strings
    plus OVERHEAD: within a few percent of what a row of short ASCII text holds, measured with
    tracemalloc); 0 turns the cache off. A row read from the database is kept only if
    it was not forgotten since the read began (`get`'s generation): a read that started before a
    change was committed may have returned the row as it was before, and, put after the change was
    forgotten, it would stay. The last RECENT forgets say which rows they were; a read older than
    those keeps nothing. Rows are not per tenant: the caller checks the tenant on each row, as it
    does on rows read from the database."""

    OVERHEAD = 600  # bytes a row holds beyond its strings' characters: objects' headers, the tuple, the maps
    RECENT = 1024  # forgets remembered (a second or more of changes under load; a read takes milliseconds)

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, tuple[tuple, int]] = OrderedDict()  # id -> (row, its size)
        self._bytes = 0
        self._generation = 0
        self._recent: deque[tuple[int, list[str] | None]] = deque(maxlen=self.RECENT)  # (generation, ids forgotten)
        self._lock = threading.Lock()

    def get(self, ids: list[str]) -> tuple[dict[str, tuple], int]:
        """The cached rows of `ids`, and the generation to hand `put` with the others once read."""
        found = {}
        if not self.max_bytes:
            return found, 0
        with self._lock:
            for memory_id in ids:
                kept = self._rows.get(memory_id)
                if kept is not None:
                    self._rows.move_to_end(memory_id)
                    found[memory_id] = kept[0]
            return found, self._generation

    def put(self, rows: list[tuple], generation: int) -> None:
        """Keep `rows` (their id first), read from the database after `get` returned `generation`."""
        if not self.max_bytes or not rows:
            return
        with self._lock:
            if generation != self._generation:  # changes meanwhile: those rows may be read from before them
                changed = self._forgotten_since(generation)
                if changed is None:
                    return
                rows = [row for row in rows if row[0] not in changed]
            for row in rows:
                memory_id = row[0]
                self._drop(memory_id)
                size = self.OVERHEAD + sum(len(value) for value in row if isinstance(value, str))
                self._rows[memory_id] = (row, size)
                self._bytes += size
            while self._bytes > self.max_bytes and self._rows:
                self._drop(next(iter(self._rows)))

    def forget(self, ids: list[str] | None = None) -> None:
        """Drop the rows of `ids`, or every row: they changed (or are about to)."""
        if not self.max_bytes:
            return
        with self._lock:
            self._generation += 1
            self._recent.append((self._generation, None if ids is None else list(ids)))
            if ids is None:
                self._rows.clear()
                self._bytes = 0
                return
            for memory_id in ids:
                self._drop(memory_id)

    def _forgotten_since(self, generation: int) -> set[str] | None:
        """The ids forgotten after `generation`; None when that is everything or no longer known."""
        if not self._recent or self._recent[0][0] > generation + 1:
            return None
        changed = set()
        for forgot_at, ids in reversed(self._recent):
            if forgot_at <= generation:
                break
            if ids is None:
                return None
            changed.update(ids)
        return changed

    def _drop(self, memory_id: str) -> None:
        kept = self._rows.pop(memory_id, None)
        if kept is not None:
            self._bytes -= kept[1]

    def __len__(self) -> int:
        return len(self._rows)


class IndexSync:
    """Applies change-log entries after the index's recorded position, in order, and keeps `rows`
    (RowCache) in step with them. `row_cache_bytes`: the cache's bound (0: no cache). `hint`: the
    head as applied by the processes sharing this SQLite file (storage/db.py HeadHint), which lets
    `follow` skip the database when nothing new was answered; None asks the database each time."""

    def __init__(self, engine: Engine, index: VectorIndex, sparse: SparseEncoder, batch_size: int = 1000,
                 row_cache_bytes: int = 0, hint: HeadHint | None = None):
        self.engine = engine
        self.index = index
        self.sparse = sparse
        self.batch_size = batch_size
        self.rows = RowCache(row_cache_bytes)
        self.hint = hint
        self._lock = threading.Lock()
        self.applied_since_optimize = 0

    @property
    def left_out(self) -> frozenset[str]:
        """Memories the index could not hold (see _apply); recorded in the index with its position."""
        return self.index.left_out

    def head(self) -> int:
        # The driver's cursor on a plain connection: every search asks this first (storage/db.py).
        with self.engine.connect() as connection:
            return change_log_head(connection)

    def follow(self, head: int | None = None) -> None:
        """Apply what other processes (workers, replicas) committed, if anything: a search then
        sees every write that was answered before it began, whichever process took the write.
        `head`: the change log's head, when the caller has just read it; else the hint says how far
        the processes that answered writes had applied them, or the database what it holds."""
        if head is None:
            head = self.hint.read() if self.hint is not None else self.head()
        if head > self.index.applied_position():
            self.catch_up()

    def catch_up(self, prepared: dict[str, IndexPoint] | None = None, own: tuple[int, int] | None = None) -> int:
        """Apply everything committed so far; returns how many entries were applied. `prepared`:
        points a writer built from the rows it has just committed (see _changes). `own`: (after,
        last) when every change-log entry in (after, last] is the writer's own, the "add" of one of
        `prepared`'s memories, and `prepared` holds nothing else: when the index has applied up to
        `after`, it applies them from `prepared` alone, without reading the change log (a connection
        from the pool and a query: ~0.1 ms of an add's ~1.5 ms outside the model, bench/analysis.md,
        round 41), and returns; entries committed after `last` wait for their own writer's catch-up
        (or the next search's, or the maintenance thread's). Otherwise everything is applied."""
        applied = 0
        with self._lock:
            if own is not None and prepared and self.index.applied_position() == own[0]:
                self.rows.forget(list(prepared))  # before the index answers from the change: see RowCache
                self._apply(list(prepared.values()), [], own[1])
                self.applied_since_optimize += len(prepared)
                self._published(own[1])
                return len(prepared)
            while True:
                position = self.index.applied_position()
                with self.engine.connect() as connection:
                    entries = driver_rows(connection, _ENTRIES.format(placeholders(connection, 1)), (position, self.batch_size))
                    if not entries:
                        self._published(position)
                        return applied
                    # Before the index answers from the change: see RowCache.
                    self.rows.forget([memory_id for _, memory_id, _ in entries])
                    points, deleted = self._changes(connection, entries, prepared or {})
                self._apply(points, deleted, entries[-1][0])
                applied += len(entries)
                self.applied_since_optimize += len(entries)
                if len(entries) < self.batch_size:
                    self._published(entries[-1][0])
                    return applied  # the query saw every entry committed before it ran

    def _published(self, position: int) -> None:
        """Tell the other processes this far is applied (HeadHint), before the lock is let go: a
        writer whose entries another thread's catch-up applied must not answer before they are
        published, and that thread publishes under the lock the writer waits for."""
        if self.hint is not None:
            self.hint.publish(position)

    def _apply(self, points: list[IndexPoint], deleted: list[str], position: int | None) -> None:
        """Write a run of entries. When the write fails because of points the index cannot hold
        (their conversion fails on its own: data no request may write any more, from a bug or an
        older version), those memories are left out of the index, and out of search, with an
        error logged and counted, instead of every later change waiting behind them for good; any
        other failure (the index down, full) is raised, and the run is tried again later. The set
        left out goes into the index with the position (it outlives a restart: the memories stay
        out until changed or deleted, or until a rebuild that can hold them)."""
        before = self.index.left_out
        # Changed or deleted since: held or deleted as any other memory.
        self.index.left_out = before.difference([p.id for p in points], deleted) if before else before
        try:
            self._write(points, deleted, position)
        except Exception:
            refused = set(self.index.refused(points))
            if not refused:
                self.index.left_out = before
                raise
            log.error("the vector index cannot hold memories %s: they stay in the database but are left out "
                      "of the index (and of search) until they are changed or deleted", sorted(refused))
            self.index.left_out = self.index.left_out | refused
            self._write([p for p in points if p.id not in refused], [*deleted, *sorted(refused)], position)

    def _write(self, points: list[IndexPoint], deleted: list[str], position: int | None) -> None:
        if position is None:  # a rebuild: it records its position once, at the end
            self.index.upsert(points)
            self.index.delete(deleted)
        else:
            self.index.apply(points, deleted, position)

    def _changes(self, connection: Connection, entries: list[tuple[int, str, str]],
                 prepared: dict[str, IndexPoint]) -> tuple[list[IndexPoint], list[str]]:
        """The points to write and the ids to delete for a run of (position, memory id, op) entries."""
        # Entries only name what changed; the row as it is now is the truth. A row that is gone
        # is deleted from the index, so replay can never resurrect a deleted memory.
        counts = Counter(memory_id for _, memory_id, _ in entries)
        wanted = list(counts)
        # A batch add builds its new memories' points while the model is still embedding, and its
        # apply skips reading them back: where the run holds a new memory's "add" entry and no other
        # entry of it, its row is as the add wrote it, and any later change is applied after this
        # run. Only then: another thread's catch-up may have applied the add's entry already, and
        # this run hold a later update or delete, which the add's point would undo (a deleted
        # memory was back in search; a review, session 28).
        added = {memory_id for _, memory_id, op in entries if op == "add"}
        ready = {i: prepared[i] for i in wanted if counts[i] == 1 and i in added and i in prepared}
        read = [i for i in wanted if i not in ready]
        rows = {}
        if read:
            sql = _POINT_ROWS + f"({placeholders(connection, len(read))})"
            rows = {r[0]: PointRow(*r) for r in driver_rows(connection, sql, read)}
        points = [ready[i] if i in ready else point_for(rows[i], self.sparse) for i in wanted if i in ready or i in rows]
        return points, [i for i in read if i not in rows]

    def rebuild(self, progress: Callable[[int, int], None] | None = None, *, reembed=None) -> int:
        """Rebuild the index from SQL alone. Stored embeddings are used as they are, unless `reembed`
        (an Embedder) is given: then every memory is embedded again and its stored vector replaced."""
        with self._lock:
            head = self.head()
            self.rows.forget()
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
                    self._apply([point_for(row, self.sparse) for row in rows], [], None)
                    done, last_id = done + len(rows), rows[-1].id
                    session.expunge_all()
                    if progress:
                        progress(done, total)
            # Anything committed after `head` is replayed on top by the next catch_up.
            self.index.set_applied_position(head)
            self.index.optimize()
            self.applied_since_optimize = 0
            return done
