"""Vector memory: add (with dedup), search (dense, keyword, hybrid), list, update, delete, history."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import uuid
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from itertools import islice
from types import SimpleNamespace
from typing import NamedTuple
from datetime import datetime, timezone

import numpy as np
from sqlalchemy import and_, delete as sql_delete, func, or_
from sqlalchemy.orm import defer
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from memory_server.auth import Principal
from memory_server.config import Settings
from memory_server.embedding import Embedder
from memory_server.errors import BadRequest, InvalidInput, NotFound, Unavailable, quoted_id
from memory_server.models import ChangeLogEntry, MemoryHistory, MemoryRecord, embedding_input, new_memory_ids, utcnow
from memory_server.schemas import (
    AddRequest, AddResponse, AddResult, HistoryEntry, MemoryOut, MemoryPage, ScoredMemory, SearchRequest,
    UpdateRequest, parse_time,
)
from memory_server.services.filters import bounds_scope, parse_filters, restrict
from memory_server.services.index_sync import IndexSync, change_log_head, point_for, scope_key
from memory_server.storage.db import RowEncoder, begin_write, driver_rows, lock_change_log, placeholders, stored_json, stored_time
from memory_server.storage.vectors import IndexPoint, IndexQuery, VectorIndex
from memory_server.storage.vectors.filters import All, Condition, Field
from memory_server.storage.vectors.sparse import SparseEncoder
from memory_server.timing import name_os_thread, stage, timed_iter

log = logging.getLogger("memory_server")
_NEVER = datetime(9999, 12, 31, tzinfo=timezone.utc)
Scope = tuple[str | None, str | None, str | None]


class Planned(NamedTuple):
    """One memory an add request will create (unless it is a duplicate)."""

    scope: Scope
    text: str
    metadata: dict
    expires_at: datetime | None
    context: str | None


NEAR_CANDIDATES = 8  # closest live memories of the scope compared for near-duplicates
TIE_MARGIN = 8  # extra hits fetched so that ties at the top_k boundary are cut deterministically
# A write of at least this many new memories has its index points converted on a thread of its
# own while the rows are inserted and committed (VectorMemory._prepare_beside).
PREPARE_BESIDE_MIN = 64
INFER_WARNING = "infer=true is not available yet: each message was stored as-is (infer=false)"


def to_public(row: MemoryRecord) -> MemoryOut:
    return MemoryOut(id=row.id, memory=row.text, user_id=row.user_id, agent_id=row.agent_id, run_id=row.run_id,
                     metadata=row.meta, created_at=row.created_at, updated_at=row.updated_at,
                     expires_at=row.expires_at, hash=row.hash)


def text_hash(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()  # mem0's `hash` field: md5 of the memory text


class AddPlan(NamedTuple):
    """An add's items, checked: the memories they make, when, and the warnings to answer with."""
    now: datetime
    memories: list[Planned]
    warnings: list[str]


class AddAhead(NamedTuple):
    """An add planned as its request arrived, its texts embedding (VectorMemory.add_ahead);
    `vectors` is None when they are too many to hand over that way (embedded when it runs)."""
    plan: AddPlan
    vectors: Future | None


class SearchAhead(NamedTuple):
    """A search checked as its request arrived, its query embedding (VectorMemory.search_ahead):
    its filters and scope as one condition, and its query vector (None for a keyword search)."""
    condition: Condition | None
    query_vector: Future | None


class Draft:
    """What an add is about to write and answer, built while the model embeds the rest of its texts."""

    def __init__(self, tenant_id: str, now: datetime, size: int, sparse: SparseEncoder, encoder: RowEncoder):
        self.tenant_id, self.now, self.sparse, self.encoder = tenant_id, now, sparse, encoder
        self.ids = iter(new_memory_ids(size))
        self.rows: list[dict] = []
        self.encoded: dict[str, list] = {}  # the rows' values for the driver, by id (see RowEncoder)
        self.fresh: list[Planned] = []  # what each row was planned as
        self.prepared: dict[str, IndexPoint] = {}  # the rows' index points (see IndexSync._changes)
        self.added: dict[Scope, list[tuple[np.ndarray, str, str]]] = {}  # the new memories' (vector, id, text)
        self.results: list[AddResult] = []
        self.noops: list[tuple[int, Planned, np.ndarray]] = []  # NOOPs to stored memories: (place in results, ...)

    def new(self, planned: Planned, vector: np.ndarray) -> AddResult:
        """A new memory's row and index point."""
        scope, text, metadata, expires_at, context = planned
        memory_id = next(self.ids)
        self.rows.append({"id": memory_id, "tenant_id": self.tenant_id, "user_id": scope[0], "agent_id": scope[1],
                          "run_id": scope[2], "text": text, "context": context, "hash": text_hash(text),
                          "metadata": metadata, "embedding": vector.tobytes(), "created_at": self.now,
                          "updated_at": self.now, "expires_at": expires_at})
        self.encoded[memory_id] = self.encoder.encode(self.rows[-1])
        self.fresh.append(planned)
        self.prepared[memory_id] = point_for(SimpleNamespace(**self.rows[-1], meta=metadata), self.sparse)
        self.added.setdefault(scope, []).append((vector, memory_id, text))
        return AddResult(id=memory_id, memory=text, event="ADD")

    def noop(self, duplicate: tuple[str, str], planned: Planned, vector: np.ndarray) -> AddResult:
        """The answer for a memory already held as `duplicate` (id, text)."""
        if duplicate[0] not in self.prepared:  # a stored one: see VectorMemory._recheck_under_lock
            self.noops.append((len(self.results), planned, vector))
        return AddResult(id=duplicate[0], memory=duplicate[1], event="NOOP")

    def drop(self, replaced: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
        """Leave out the new memories that turned out to be held already, as {id: (stored id, text)};
        the answers that named them name the stored memory (`added` keeps them: a near duplicate of
        one is a duplicate of what replaced it). Returns `replaced`."""
        if replaced:
            kept = [(row, planned) for row, planned in zip(self.rows, self.fresh) if row["id"] not in replaced]
            self.rows, self.fresh = [row for row, _ in kept], [planned for _, planned in kept]
            for memory_id in replaced:
                self.prepared.pop(memory_id)
            self.results[:] = [AddResult(id=replaced[r.id][0], memory=replaced[r.id][1], event="NOOP")
                               if r.id in replaced else r for r in self.results]
        return replaced


class VectorMemory:
    def __init__(self, settings: Settings, engine: Engine, embedder: Embedder, index: VectorIndex,
                 sync: IndexSync, sparse: SparseEncoder):
        self.settings = settings
        self.engine = engine
        self.embedder = embedder
        self.index = index
        self.sync = sync
        self.sparse = sparse
        self._memory_rows = RowEncoder(engine, MemoryRecord.__table__, late=("created_at", "updated_at"))
        self._history_rows = RowEncoder(engine, MemoryHistory.__table__, late=("created_at",), leave_out=("id",))
        self._log_rows = RowEncoder(engine, ChangeLogEntry.__table__, late=("created_at",), leave_out=("position",))
        self._preparer: ThreadPoolExecutor | None = None
        self._preparer_lock = threading.Lock()
        # When a search or a change last used the index (time.monotonic(); an expiry sweep that
        # deletes something counts too): the maintenance thread optimizes the index
        # while they leave it alone (Runtime._optimize_due).
        self.last_active = time.monotonic()

    def _prepare_beside(self, points: dict[str, IndexPoint]) -> Future | None:
        """`points` converted into the index's own form (VectorIndex.prepare) on another thread, for
        the write that follows the commit; None for a few points, which cost less than the hand-over.
        A batch add's points are final only once its rows are stamped under the write lock, and their
        conversion (~35 µs a point on Edge, mostly the payload) then ran on one core after the model
        had finished, while the other idled: beside the inserts and the commit it costs no time."""
        if len(points) < PREPARE_BESIDE_MIN:
            return None
        with self._preparer_lock:
            if self._preparer is None:
                self._preparer = ThreadPoolExecutor(1, thread_name_prefix="index-prepare", initializer=name_os_thread)
        prepare = self.index.prepare
        return self._preparer.submit(lambda: {i: prepare(p) for i, p in points.items()})

    def _publish(self, prepared: dict[str, IndexPoint] | None = None, own: tuple[int, int] | None = None) -> None:
        """Apply the committed change to the index before answering (read-your-writes); every write
        calls it after its commit. The catch-up also tells the other processes on this SQLite file
        how far it applied (HeadHint): their searches rely on it to see this write. (A write that
        skipped it would reach them with the maintenance thread's next catch-up, within a second.)
        `prepared`, `own`: see IndexSync.catch_up."""
        self.last_active = time.monotonic()
        try:
            with stage("index"):
                self.sync.catch_up(prepared, own)
        except Exception as exc:
            log.exception("vector index apply failed")
            raise Unavailable("the change is saved, but the vector index could not apply it yet; "
                              "it is applied automatically once the index recovers") from exc

    # -- add -------------------------------------------------------------------------------
    def add(self, principal: Principal, request: AddRequest, ahead: AddAhead | None = None) -> AddResponse:
        """`ahead`: what add_ahead made of this same request, its texts embedding already."""
        if ahead is not None:
            return self._add(principal, ahead.plan, ahead.vectors)
        with self.embedder.coming():  # its texts are on their way: a model call may wait for them
            return self._add(principal, self._plan(principal, [request], batch=False))

    def add_ahead(self, principal: Principal, request: AddRequest) -> AddAhead:
        """An add's checks (raising what add would), and its texts handed to the model at once
        (Embedder.embed_soon), for `add(..., ahead=)` to store once they are embedded: the HTTP
        layer calls it as the request arrives, on the event loop (api/memories.py)."""
        plan = self._plan(principal, [request], batch=False)
        return AddAhead(plan, self.embedder.embed_soon([embedding_input(p.text, p.context) for p in plan.memories]))

    def add_batch(self, principal: Principal, items: list[AddRequest]) -> AddResponse:
        if len(items) > self.settings.max_batch_items:
            raise InvalidInput(f"a batch holds at most {self.settings.max_batch_items} items", field="items")
        return self._add(principal, self._plan(principal, items, batch=True))

    def _plan(self, principal: Principal, items: list[AddRequest], *, batch: bool) -> AddPlan:
        """What an add's items make, checked: raises on bad input before anything is embedded."""
        now = utcnow()
        planned: list[Planned] = []
        warnings: list[str] = []
        for i, item in enumerate(items):
            prefix = f"items[{i}]." if batch else ""
            user_id, agent_id = principal.resolve_write_scope(item.user_id, item.agent_id, prefix)
            scope = (user_id, agent_id, item.run_id)
            if not any(scope):
                raise InvalidInput("at least one of user_id, agent_id, run_id is required", field=f"{prefix}user_id")
            if item.expires_at is not None and item.expires_at <= now:
                raise InvalidInput("expires_at is in the past", field=f"{prefix}expires_at")
            if item.infer and INFER_WARNING not in warnings:
                warnings.append(INFER_WARNING)
            for text, extra, context in self._texts_of(item, prefix):
                planned.append(Planned(scope, text, {**(item.metadata or {}), **extra}, item.expires_at, context))
        if len(planned) > self.settings.max_batch_items:
            raise InvalidInput(f"a request may create at most {self.settings.max_batch_items} memories",
                               field="items" if batch else "messages")
        return AddPlan(now, planned, warnings)

    def _add(self, principal: Principal, plan: AddPlan, embedding: Future | None = None) -> AddResponse:
        """Stores what `plan` makes; `embedding`: its vectors, handed to the model already."""
        now, planned, warnings = plan
        if embedding is not None:
            with stage("embed"):
                vectors = iter(embedding.result())
        else:  # vectors arrive in order while the rest are still being embedded (see embed_ahead)
            vectors = timed_iter("embed", self.embedder.embed_ahead([embedding_input(p.text, p.context) for p in planned]))
        draft = Draft(principal.tenant_id, now, len(planned), self.sparse, self._memory_rows)
        # A plain connection, no ORM session: an add runs Core statements only, and the session's
        # machinery cost ~110 µs a statement (bench/analysis.md, round 21).
        with self.engine.connect() as connection:
            with stage("db"):
                head = change_log_head(connection)  # a later write moves it: see _recheck_under_lock
                existing = self._exact_duplicates(connection, principal.tenant_id, planned, now)
            self._follow(head)  # the near-duplicate check asks the index: it must hold what others wrote
            for group in _groups(zip(planned, vectors), self.embedder.batch_size):
                stored = self._stored_near_duplicates(connection, principal.tenant_id, group, existing, now)
                for (planned_memory, vector), candidates in zip(group, stored):
                    scope, text, context = planned_memory.scope, planned_memory.text, planned_memory.context
                    # A message embedded with its conversation is compared by text only: overlapping
                    # context makes neighbouring turns look alike to the model.
                    duplicate = existing.get((scope, text_hash(text))) or (None if context else self._near_duplicate(
                        text, vector, draft.added.get(scope, ()), candidates))
                    if duplicate:  # the memory already held, as stored
                        draft.results.append(draft.noop(duplicate, planned_memory, vector))
                    else:
                        draft.results.append(draft.new(planned_memory, vector))
                        existing[(scope, text_hash(text))] = (draft.rows[-1]["id"], text)
            with stage("db"):
                if draft.rows:
                    begin_write(connection)
                    locked_at, locked_head = utcnow(), change_log_head(connection)
                    moved = locked_head != head
                    if moved or draft.noops:
                        self._recheck_under_lock(connection, draft, locked_at, moved)
                converted = own = None
                if draft.rows:
                    _stamp(draft.rows, draft.prepared, locked_at)
                    # The driver's own insert of values converted as the rows were made (RowEncoder):
                    # the ORM's bulk path cost more than the rows, SQLAlchemy Core's twice the driver.
                    self._memory_rows.insert(connection, [draft.encoded[row["id"]] for row in draft.rows],
                                             created_at=locked_at, updated_at=locked_at)
                    self._record(connection, [(SimpleNamespace(**r), None, r["text"]) for r in draft.rows], "ADD",
                                 principal.key_id)
                    # Every change-log entry after the head read under the lock is this add's own (every
                    # write of the log holds the lock): the index applies them without reading them back.
                    own = (locked_head, change_log_head(connection))
                    converted = self._prepare_beside(draft.prepared)  # beside the commit, which leaves the GIL
                connection.commit()
        self._publish(converted.result() if converted is not None else draft.prepared, own)
        return AddResponse(results=draft.results, warnings=warnings)

    def _follow(self, head: int | None = None) -> None:
        """Bring the index up to what other processes (workers, replicas) committed before this
        request began (`head`, when the caller has read it already), so that a search, or an add's
        near-duplicate check, sees every write answered before it: a near-duplicate added through
        another worker right after the first was stored twice. On failure, the index is used as it
        is; the maintenance thread retries."""
        self.last_active = time.monotonic()
        try:
            with stage("index"):
                self.sync.follow(head)
        except Exception:
            log.exception("vector index could not follow the change log")

    def _recheck_under_lock(self, connection: Connection, draft: Draft, now: datetime, moved: bool) -> None:
        """Correct an add's draft once the write lock is held (at `now`), when something was written
        since the add's own checks, which ran without the lock so that adds embed side by side, or
        when it answers NOOP to stored memories (one may have expired meanwhile, which writes nothing):
        - a memory that another add (a retry, another worker) committed meanwhile makes this add's
          copy of it a NOOP to that memory;
        - a stored memory this add answers NOOP to that was deleted, expired or changed meanwhile
          no longer holds the fact (a batch said NOOP to memories a scope delete had just removed,
          49 of 60 rounds; a review, session 28): the fact is a NOOP to another stored memory that
          holds it in other words, if one does (checked against the index as this add followed it),
          or else added after all.
        Only the exact-text check and the NOOP targets' rows run under the lock (~0.2 ms an add, ~25
        ms a batch of 1,000 on a Zen 3; the new rows' check only when the change log `moved`). Expiry
        is judged at `now`, not when the add began: a NOOP to a memory that expired while the add
        embedded stored the fact nowhere (a review, session 29)."""
        results = draft.results
        live = _live_texts(connection, {results[place].id for place, _, _ in draft.noops}, now)
        lost = [(place, p, vector) for place, p, vector in draft.noops
                if live.get(results[place].id) != results[place].memory]
        if not (moved or lost):
            return
        late = self._exact_duplicates(connection, draft.tenant_id,
                                      [*(draft.fresh if moved else ()), *(p for _, p, _ in lost)], now)
        replaced = draft.drop({row["id"]: late[(planned.scope, row["hash"])] for row, planned in zip(draft.rows, draft.fresh)
                               if (planned.scope, row["hash"]) in late})
        # A lost fact may still be held by another stored memory in other words: the index as this
        # add followed it (a point changed since may be stale: the lost targets are never taken).
        gone = {results[place].id for place, _, _ in lost}
        stored = self._stored_near_duplicates(connection, draft.tenant_id, [(p, v) for _, p, v in lost], late, now) if lost else []
        for (place, planned, vector), candidates in zip(lost, stored):
            key = (planned.scope, text_hash(planned.text))
            duplicate = late.get(key) or self._near_duplicate(planned.text, vector, draft.added.get(planned.scope, ()),
                                                              [c for c in candidates if c[0] not in gone])
            duplicate = replaced.get(duplicate[0], duplicate) if duplicate else None
            # The first of the lost ones with its text is added, the ones like it are NOOPs to it.
            results[place] = (AddResult(id=duplicate[0], memory=duplicate[1], event="NOOP") if duplicate
                              else draft.new(planned, vector))
            late.setdefault(key, (results[place].id, results[place].memory))

    def _texts_of(self, item: AddRequest, prefix: str) -> list[tuple[str, dict, str | None]]:
        """(text, extra metadata, conversation context) for each memory an add item makes. A message
        is embedded after up to `message_context_turns` messages before it, so that "Yes, last May!"
        is found by what it answers."""
        if (item.text is None) == (item.messages is None):
            raise InvalidInput("give exactly one of `messages` or `text`", field=f"{prefix}messages")
        if item.text is not None:
            text = item.text.strip()
            self._check_text(text, f"{prefix}text")
            return [(text, {}, None)]
        out, seen = [], []
        for j, message in enumerate(item.messages):
            if message.role == "system":
                continue
            text = message.content.strip()
            self._check_text(text, f"{prefix}messages[{j}].content")
            turns = self.settings.message_context_turns
            context = "\n".join(seen[-turns:]) if turns and seen else None
            out.append((text, {**(message.metadata or {}), "role": message.role}, context))  # the role last
            seen.append(text)
        if not out:
            raise InvalidInput("`messages` holds no non-system message", field=f"{prefix}messages")
        return out

    def _check_text(self, text: str, field: str) -> None:
        if not text:
            raise InvalidInput("memory text must not be empty", field=field)
        if "\x00" in text:
            raise InvalidInput("memory text must not contain NUL characters", field=field)
        if len(text.encode()) > self.settings.max_memory_bytes:
            raise InvalidInput(f"memory text exceeds {self.settings.max_memory_bytes} bytes", field=field)

    def _exact_duplicates(self, connection: Connection, tenant_id: str, planned: list[Planned], now: datetime) -> dict:
        """Live memories with the same text in the same scope as a planned one: {(scope, hash): (id, text)}."""
        keys = {(p.scope, text_hash(p.text)) for p in planned}
        hashes = sorted({h for _, h in keys})
        # Common texts recur across users, so the rows with these hashes grow with the store. The
        # first query reads only the hash index (it holds the scope), keeps only the (hash, user)
        # pairs of the batch there, in SQL, and the rows themselves are read only for those:
        # reading every matching row (with its 1.5 KB embedding beside it) was a quarter of a batch
        # add's own work at ~500k memories, and so was taking every user's index entry into Python
        # at ~350k.
        scopes = {scope for scope, _ in keys}
        pairs = sorted({(h, scope[0]) for scope, h in keys if scope[0] is not None})
        found = _same_hash(connection, _HASH_SCOPES, tenant_id, hashes, pairs)
        wanted = {((u, a, r), h) for u, a, r, h in found if (u, a, r) in scopes}
        if not wanted:
            return {}
        found = _same_hash(connection, _HASH_ROWS, tenant_id, sorted({h for _, h in wanted}), pairs)
        # Expiry is judged here, on the few rows of the wanted scopes, as a search's hits are.
        return {((u, a, r), h): (i, text) for i, u, a, r, h, text, expires_at in found
                if ((u, a, r), h) in wanted and _unexpired(expires_at, now)}

    def _stored_near_duplicates(self, connection: Connection, tenant_id: str, group: list[tuple[Planned, np.ndarray]],
                                existing: dict, now: datetime) -> list[list[tuple[str, str]]]:
        """For each planned memory of a group: the stored memories of its scope that it comes close
        to (cosine >= the dedup threshold), as (id, text), closest first. One batched index query
        and one SQL query for the whole group. The index query leaves expired points out only while
        the index may hold any (the range made a query ~35% dearer: 0.38 vs 0.28 ms at 200k
        memories); without it, expired copies not yet swept could fill the NEAR_CANDIDATES places and
        hide a live near-duplicate. The rows are checked for expiry either way."""
        threshold = self.settings.dedup_threshold
        wanted = [i for i, (p, _) in enumerate(group) if not p.context and (p.scope, text_hash(p.text)) not in existing]
        alive = (Field("expires_at", "gt", now.timestamp()),) if self.index.may_hold_expired(now.timestamp()) else ()
        # Only the close ones come back (min_score): the rest cost the index's answer and Python
        # objects for nothing (8 ids a memory, ~5% of a batch add's calling thread at 10k).
        queries = [IndexQuery(mode="dense", limit=NEAR_CANDIDATES, dense=group[i][1].tolist(), min_score=threshold, filter=All((
            Field("scope", "eq", scope_key(tenant_id, *group[i][0].scope)), *alive,
        ))) for i in wanted]
        with stage("index"):
            hit_lists = self.index.search_batch(queries) if queries else []
        close = {i: [hit.id for hit in hits if hit.score >= threshold] for i, hits in zip(wanted, hit_lists)}
        ids = {memory_id for found in close.values() for memory_id in found}
        with stage("db"):
            texts = _live_texts(connection, ids, now)
        return [[(m, texts[m]) for m in close.get(i, ()) if m in texts] for i in range(len(group))]

    def _near_duplicate(self, text: str, vector: np.ndarray, added: list[tuple[np.ndarray, str, str]],
                        stored: list[tuple[str, str]]) -> tuple[str, str] | None:
        """A memory of the same scope, added earlier in this request or stored, that is this one in
        other words: cosine >= the dedup threshold (stored ones come pre-selected by it), and the
        same numbers (so "order O-1002" and "order O-1010", which MiniLM embeds almost identically,
        stay two memories)."""
        numbers = _numbers(text)
        for other_vector, other_id, other_text in added:
            if float(np.dot(vector, other_vector)) >= self.settings.dedup_threshold and _numbers(other_text) == numbers:
                return other_id, other_text
        return next(((i, t) for i, t in stored if _numbers(t) == numbers), None)

    def _record(self, session: Session | Connection, changes: list[tuple], event: str, actor: str) -> None:
        """History entries and change-log entries for (memory, old text, new text) changes, in the
        same transaction as the change itself."""
        if not changes:
            return
        lock_change_log(session)
        connection = session if isinstance(session, Connection) else session.connection()
        now = utcnow()
        history, log = self._history_rows, self._log_rows  # the driver's inserts: see RowEncoder
        history.insert(connection, [history.encode(
            {"memory_id": m.id, "tenant_id": m.tenant_id, "user_id": m.user_id, "agent_id": m.agent_id,
             "event": event, "old_memory": old, "new_memory": new, "actor": actor}) for m, old, new in changes],
            created_at=now)
        op = {"DELETE": "delete", "ADD": "add"}.get(event, "upsert")
        log.insert(connection, [log.encode({"tenant_id": m.tenant_id, "memory_id": m.id, "op": op}) for m, _, _ in changes],
                   created_at=now)

    # -- search ----------------------------------------------------------------------------
    def search(self, principal: Principal, request: SearchRequest, ahead: SearchAhead | None = None) -> list[ScoredMemory]:
        """`ahead`: what search_ahead made of this same request, its query embedding already."""
        if ahead is not None:
            return self._search(principal, request, ahead.condition, ahead.query_vector)
        condition = self._condition(principal, request)
        if request.mode == "keyword":  # no query to embed
            return self._search(principal, request, condition)
        with self.embedder.coming():  # its query is on its way: a model call may wait for it
            return self._search(principal, request, condition)

    def search_ahead(self, principal: Principal, request: SearchRequest) -> SearchAhead:
        """The search's checks (raising what search would), and its query handed to the model now
        (Embedder.query_soon), for `search(..., ahead=)`; a keyword search embeds nothing. The HTTP
        layer calls it as the request arrives, on the event loop (api/memories.py)."""
        condition = self._condition(principal, request)
        return SearchAhead(condition, self.embedder.query_soon(request.query) if request.mode != "keyword" else None)

    def _search(self, principal: Principal, request: SearchRequest, condition: Condition | None,
                query_vector: Future | None = None) -> list[ScoredMemory]:
        """`condition`: the request's, checked (_condition); `query_vector`: its query, embedding already."""
        self._follow()
        now = utcnow()
        scope = restrict(principal, condition)
        # Expired memories wait in the index for the expiry sweep. The index query filters them out
        # only when the index may hold one: the condition is checked on each of the scope's points
        # (~0.5 ms of a dense query for one user at 1M memories). Rows are checked for expiry either
        # way; should a hit be expired all the same (an old change the index applied just now), the
        # search runs again with the condition: never fewer results than with it all along.
        expiring = All((scope, Field("expires_at", "gt", now.timestamp())))
        settings = self.settings
        dense = None
        if request.mode != "keyword":
            with stage("embed"):
                dense = (query_vector.result() if query_vector else self.embedder.embed_query(request.query)).tolist()
        query = IndexQuery(
            mode=request.mode,
            filter=expiring if self.index.may_hold_expired(now.timestamp()) else scope,
            limit=request.top_k + TIE_MARGIN,
            dense=dense,
            sparse=self.sparse.query(request.query) if request.mode != "dense" else None,
            candidates=max(settings.search_candidates, request.top_k),
            rrf_k=settings.rrf_k,
            weights=(settings.hybrid_dense_weight, settings.hybrid_keyword_weight),
        )
        results, expired = self._answer(principal, request, query, now)
        if expired and query.filter is scope:
            results, _ = self._answer(principal, request, replace(query, filter=expiring), now)
        return results

    @staticmethod
    def _condition(principal: Principal, request: SearchRequest) -> Condition | None:
        """The search's filters and scope fields as one condition, checked: it must bound a scope."""
        parts: list[Condition] = []
        if request.filters is not None:
            parts.append(parse_filters(request.filters))
        for name in ("user_id", "agent_id", "run_id"):
            if getattr(request, name) is not None:
                parts.append(Field(name, "eq", getattr(request, name)))
        condition = All(tuple(parts)) if parts else None
        if not (principal.user_ids or principal.agent_ids or (condition is not None and bounds_scope(condition))):
            raise InvalidInput("a search must name at least one of user_id, agent_id, run_id in filters",
                               field="filters")
        return condition

    def _answer(self, principal: Principal, request: SearchRequest, query: IndexQuery,
                now: datetime) -> tuple[list[ScoredMemory], bool]:
        """The index query's hits as results, and whether a hit was left out because it had expired."""
        with stage("index"):
            hits = self.index.search(query)
        used = query.weights if query.sparse and query.sparse.indices else query.weights[:1]
        scored = list(zip([hit.id for hit in hits],
                          normalize_scores(request.mode, [hit.score for hit in hits], query.rrf_k, used)))
        # Equal scores (common in RRF) are ordered by id, so that the same hits come back in the
        # same order everywhere. Equal BM25 scores inside a hybrid search's candidate lists, which
        # Qdrant ranks in no fixed order, are made rare by sparse.tie_break (bench/analysis.md,
        # round 24).
        scored = sorted(scored, key=lambda pair: (-pair[1], pair[0]))[:request.top_k]
        if request.threshold is not None:
            scored = [(i, s) for i, s in scored if s >= request.threshold]
        if not scored:
            return [], False
        # By primary key alone: with the tenant in the WHERE clause too, SQLite may walk the tenant's
        # index instead. Tenant and expiry are checked on the rows. The driver's cursor, no ORM and no
        # SQLAlchemy statement: their machinery cost 4x the lookup itself (storage/db.py).
        ids = [i for i, _ in scored]
        cached, generation = self.sync.rows.get(ids)  # rows as of the change log this search followed
        if missing := [i for i in ids if i not in cached]:
            with stage("db"), self.engine.connect() as connection:
                read = [HitRow.of(r) for r in driver_rows(connection, _HIT_ROWS + f"({placeholders(connection, len(missing))})",
                                                          missing)]
            self.sync.rows.put(read, generation)
            cached.update((r.id, r) for r in read)
        found = [r for i in ids if (r := cached.get(i)) is not None and r.tenant_id == principal.tenant_id]
        rows = {r.id: r for r in found if r.expires_at is None or r.expires_at > now}
        results = [ScoredMemory(id=r.id, memory=r.text, user_id=r.user_id, agent_id=r.agent_id, run_id=r.run_id,
                                metadata=r.metadata(), created_at=r.created_at, updated_at=r.updated_at,
                                expires_at=r.expires_at, hash=r.hash, score=s)
                   for i, s in scored if (r := rows.get(i)) is not None]
        return results, len(rows) < len(found)

    # -- read, update, delete --------------------------------------------------------------
    def _load(self, session: Session, principal: Principal, memory_id: str) -> MemoryRecord:
        row = session.get(MemoryRecord, memory_id) if _is_uuid(memory_id) else None
        if (row is None or row.tenant_id != principal.tenant_id or not principal.can_see(row.user_id, row.agent_id)
                or (row.expires_at is not None and row.expires_at <= utcnow())):
            raise NotFound(f"no memory '{quoted_id(memory_id)}'")
        return row

    def get(self, principal: Principal, memory_id: str) -> MemoryOut:
        with Session(self.engine) as session:
            return to_public(self._load(session, principal, memory_id))

    def list(self, principal: Principal, *, user_id: str | None = None, agent_id: str | None = None,
             run_id: str | None = None, limit: int = 100, cursor: str | None = None) -> MemoryPage:
        now = utcnow()
        with Session(self.engine) as session:
            query = _readable().where(*self._scope_clauses(principal, user_id, agent_id, run_id), _alive(now))
            if cursor:
                created, last_id = _decode_cursor(cursor)
                query = query.where(or_(MemoryRecord.created_at < created,
                                        and_(MemoryRecord.created_at == created, MemoryRecord.id < last_id)))
            rows = session.exec(query.order_by(col(MemoryRecord.created_at).desc(), col(MemoryRecord.id).desc())
                                .limit(limit + 1)).all()
        page = [to_public(r) for r in rows[:limit]]
        next_cursor = _encode_cursor(rows[limit - 1]) if len(rows) > limit else None
        return MemoryPage(results=page, next_cursor=next_cursor)

    def _scope_clauses(self, principal: Principal, user_id, agent_id, run_id) -> list:
        clauses = [MemoryRecord.tenant_id == principal.tenant_id]
        for name, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
            principal.check_value(name, value)
            if value is not None:
                clauses.append(getattr(MemoryRecord, name) == value)
        if principal.user_ids:
            clauses.append(col(MemoryRecord.user_id).in_(principal.user_ids))
        if principal.agent_ids:
            clauses.append(col(MemoryRecord.agent_id).in_(principal.agent_ids))
        return clauses

    def update(self, principal: Principal, memory_id: str, request: UpdateRequest) -> MemoryOut:
        given = request.model_fields_set
        if not given & {"text", "metadata", "expires_at"}:
            raise InvalidInput("give at least one of text, metadata, expires_at", field="text")
        now = utcnow()
        text = (request.text or "").strip() if "text" in given else None
        if text is not None:
            self._check_text(text, "text")
        if "expires_at" in given and request.expires_at is not None and request.expires_at <= now:
            raise InvalidInput("expires_at is in the past", field="expires_at")
        # The new text is embedded before the write lock is taken, so that writers do not wait for
        # the model; the row is read again under the lock (another request may have changed it).
        with Session(self.engine) as session:
            seen = self._load(session, principal, memory_id)
        vector = (self.embedder.embed([embedding_input(text, seen.context)])[0]
                  if text is not None and text != seen.text else None)
        with Session(self.engine) as session:
            row = self._locked(session, principal, memory_id)
            old_text = row.text
            if text is not None and text != row.text:
                if vector is None:  # the text it had when first read was this one; it changed since
                    vector = self.embedder.embed([embedding_input(text, row.context)])[0]
                row.text, row.hash, row.embedding = text, text_hash(text), vector.tobytes()
            if "metadata" in given:
                row.meta = request.metadata or {}
            if "expires_at" in given:
                row.expires_at = request.expires_at
            row.updated_at = now
            session.add(row)
            self._record(session, [(row, old_text, row.text)], "UPDATE", principal.key_id)
            result = to_public(row)  # as written: once committed, another request may delete it
            session.commit()
        self._publish()
        return result

    def delete(self, principal: Principal, memory_id: str) -> int:
        with Session(self.engine) as session:
            row = self._locked(session, principal, memory_id)
            self._delete_rows(session, [row], principal.key_id)
            session.commit()
        self._publish()
        return 1

    def _locked(self, session: Session, principal: Principal, memory_id: str) -> MemoryRecord:
        """The memory as it is once this session holds the write lock: a change or delete made by
        another request meanwhile is seen, and none is made until this session commits (two
        requests changing one memory at once were both applied to what each had read: history
        entries that did not follow each other, and 500s from an update whose row was deleted)."""
        begin_write(session.connection())
        return self._load(session, principal, memory_id)

    def delete_scope(self, principal: Principal, *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None) -> int:
        if not (user_id or agent_id or run_id):
            raise InvalidInput("name at least one of user_id, agent_id, run_id", field="user_id")
        with Session(self.engine) as session:
            begin_write(session.connection())
            rows = session.exec(select(MemoryRecord).where(*self._scope_clauses(principal, user_id, agent_id, run_id))).all()
            deleted = self._delete_rows(session, rows, principal.key_id)
            session.commit()
        self._publish()
        return len(deleted)

    def _delete_rows(self, session: Session, rows: list[MemoryRecord], actor: str) -> list[MemoryRecord]:
        """Delete rows read under the write lock (begin_write) and record them."""
        ids = [row.id for row in rows]
        for start in range(0, len(ids), 500):
            session.execute(sql_delete(MemoryRecord).where(col(MemoryRecord.id).in_(ids[start:start + 500]))
                            .execution_options(synchronize_session=False))
        self._record(session, [(row, row.text, None) for row in rows], "DELETE", actor)
        return rows

    def purge_expired(self, limit: int = 1000) -> int:
        now = utcnow()
        with Session(self.engine) as session:
            begin_write(session.connection())
            rows = session.exec(select(MemoryRecord).where(col(MemoryRecord.expires_at).is_not(None),
                                                           MemoryRecord.expires_at <= now).limit(limit)).all()
            if not rows:
                return 0
            self._delete_rows(session, rows, "system:expiry")
            session.commit()
        self._publish()
        return len(rows)

    def history(self, principal: Principal, memory_id: str) -> list[HistoryEntry]:
        if not _is_uuid(memory_id):
            raise NotFound(f"no memory '{quoted_id(memory_id)}'")
        with Session(self.engine) as session:
            rows = session.exec(select(MemoryHistory).where(MemoryHistory.memory_id == memory_id,
                                                            MemoryHistory.tenant_id == principal.tenant_id)
                                .order_by(MemoryHistory.id)).all()
        if not rows or not principal.can_see(rows[0].user_id, rows[0].agent_id):
            raise NotFound(f"no memory '{quoted_id(memory_id)}'")
        return [HistoryEntry(event=r.event, old_memory=r.old_memory, new_memory=r.new_memory, actor=r.actor,
                             created_at=r.created_at) for r in rows]


def normalize_scores(mode: str, raw: list[float], rrf_k: int, weights: tuple[float, ...]) -> list[float]:
    """Map a search's backend scores into [0, 1]; docs/vector-memory.md says what each mode's score means."""
    if mode == "dense":
        values = raw  # cosine similarity
    elif mode == "keyword":
        values = [score / (score + 1.0) for score in raw]  # BM25 squashed: 0 = no match, 0.5 = BM25 of 1, -> 1 as BM25 grows
    else:
        # Qdrant's weighted RRF gives rank r (from 0) in a list of weight w the score
        # 1 / (k - 1 + (r + 1) / w); divided by its maximum (rank 0 everywhere) it becomes 1.0 for a
        # memory ranked first by every retriever.
        best = sum(1.0 / (rrf_k - 1 + 1.0 / w) for w in weights if w > 0)
        values = [score / best for score in raw] if best else [0.0] * len(raw)
    return [round(min(1.0, max(0.0, value)), 6) for value in values]


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _stamp(rows: list[dict], prepared: dict[str, IndexPoint], now: datetime) -> None:
    """An add's creation time, taken under the write lock: adds then commit in the order of their
    times, so a listing's later pages never meet a memory committed after its first page was read
    (a slow batch that began before a quick add used to commit after it, with the earlier time)."""
    for row in rows:
        row["created_at"] = row["updated_at"] = now
        payload = prepared[row["id"]].payload
        payload["created_at"] = payload["updated_at"] = now.timestamp()


def _live_texts(connection: Connection, ids: set[str], now: datetime) -> dict[str, str]:
    """{id: text} of the given memories (the ones that exist and have not expired)."""
    if not ids:
        return {}
    sql = f"SELECT id, text, expires_at FROM {MemoryRecord.__tablename__} WHERE id IN ({placeholders(connection, len(ids))})"
    return {i: text for i, text, expires_at in driver_rows(connection, sql, sorted(ids))
            if _unexpired(expires_at, now)}


def _unexpired(expires_at, now: datetime) -> bool:
    """Whether a row's `expires_at` as the driver gives it (storage/db.py stored_time) is unset or after `now`."""
    return expires_at is None or stored_time(expires_at) > now


def _groups(items, size: int):
    """Consecutive lists of `size` items (the last one shorter) from any iterable, lazily."""
    iterator = iter(items)
    while group := list(islice(iterator, size)):
        yield group


def _numbers(text: str) -> list[str]:
    return sorted(_NUMBER.findall(text))


class HitRow(NamedTuple):
    """What a search returns of a hit's row: its times read once (storage/db.py stored_time), its
    metadata decoded once when flat, else as JSON text (`metadata()` gives each search its copy)."""
    id: str
    tenant_id: str
    user_id: str | None
    agent_id: str | None
    run_id: str | None
    text: str
    meta: object
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    hash: str

    @classmethod
    def of(cls, values: tuple) -> "HitRow":
        """A row as the driver gave it, its times parsed and its metadata decoded (PostgreSQL's driver
        decodes it itself). A cached row is shared by the searches that read it, so each gets its
        own copy of the metadata (a dict could be changed): flat metadata (no dict or list inside,
        as most is) is kept decoded and copied, a tenth of decoding it again (an empty one: 0.16
        against 1.7 µs, ten hits a search; bench/analysis.md, round 37); nested metadata is kept as
        JSON text and decoded for each search. The datetimes, which cannot be changed, are parsed
        once for all of them (three per hit: ~40 µs of a ten-hit search)."""
        row = cls(*values)
        meta = stored_json(row.meta)
        if not (isinstance(meta, dict) and all(isinstance(v, _SCALARS) for v in meta.values())):
            meta = row.meta if isinstance(row.meta, (str, bytes)) else json.dumps(meta)
        return row._replace(meta=meta, created_at=stored_time(row.created_at), updated_at=stored_time(row.updated_at),
                            expires_at=stored_time(row.expires_at))

    def metadata(self) -> dict:
        """This search's own copy of the metadata."""
        return dict(self.meta) if isinstance(self.meta, dict) else stored_json(self.meta)


_SCALARS = (str, int, float, bool, type(None))  # the values a shallow copy of metadata copies whole


# The id list (placeholders) is added when it runs.
_HIT_ROWS = ("SELECT id, tenant_id, user_id, agent_id, run_id, text, metadata, created_at, updated_at, expires_at, hash "
             f"FROM {MemoryRecord.__tablename__} WHERE id IN ")


# An add's exact-text check (_exact_duplicates): the rows with one of the add's hashes whose (hash,
# user) pair is the add's (or that have no user). First only the scopes (the hash index holds them),
# then the rows of the scopes wanted.
_HASH_SCOPES = "user_id, agent_id, run_id, hash"
_HASH_ROWS = "id, user_id, agent_id, run_id, hash, text, expires_at"


def _same_hash(connection: Connection, columns: str, tenant_id: str, hashes: list[str],
               pairs: list[tuple[str, str]]) -> list[tuple]:
    """`columns` of the tenant's rows with one of `hashes` whose (hash, user_id) is one of `pairs`
    or that have no user, as plain SQL on the driver's cursor (storage/db.py driver_rows): every add
    runs it, twice under concurrent writes (again under the write lock); through SQLAlchemy, with
    its expanding parameters, the first query took 58 µs of CPU against 13 on SQLite, and 162
    against 74 µs on PostgreSQL (bench/analysis.md, round 37). SQLite takes a row value IN only
    from a subquery (VALUES); PostgreSQL takes the list as it is."""
    mark = placeholders(connection, 1)
    by_user = "1 = 0"
    if pairs:
        rows = ", ".join([f"({mark}, {mark})"] * len(pairs))
        by_user = f"(hash, user_id) IN ({'VALUES ' if connection.dialect.name == 'sqlite' else ''}{rows})"
    sql = (f"SELECT {columns} FROM {MemoryRecord.__tablename__} WHERE tenant_id = {mark} "
           f"AND hash IN ({placeholders(connection, len(hashes))}) AND (user_id IS NULL OR {by_user})")
    return driver_rows(connection, sql, (tenant_id, *hashes, *(value for pair in pairs for value in pair)))


def _readable():
    """Rows for reading: the stored embedding (1.5 KB a row) stays in the database."""
    return select(MemoryRecord).options(defer(MemoryRecord.embedding), defer(MemoryRecord.context))


def _is_uuid(value) -> bool:
    try:
        return isinstance(value, str) and str(uuid.UUID(value)) == value
    except ValueError:
        return False


def _alive(now: datetime):
    # COALESCE hides expires_at from the query planner: with `IS NULL OR >`, SQLite picks the
    # expires_at index and scans the whole table instead of using the primary key or scope index.
    return func.coalesce(MemoryRecord.expires_at, _NEVER) > now


def _encode_cursor(row: MemoryRecord) -> str:
    raw = json.dumps([row.created_at.isoformat(), row.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created, last_id = json.loads(base64.urlsafe_b64decode(padded))
        if not _is_uuid(last_id):
            raise ValueError(last_id)
        # In UTC here (parse_time): a time near the calendar's ends in another zone
        # (9999-12-31T23:59:59-05:00) has no UTC value, and failed later, as the query's parameter (a 500).
        return parse_time(created), str(last_id)
    except Exception:
        raise BadRequest("cursor is not one this server issued", field="cursor", code="invalid_cursor") from None
