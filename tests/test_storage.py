"""Storage behaviour on SQLite and PostgreSQL: restart, reindex, crash repair, change-log replay."""

import dataclasses
import os
import sqlite3
import threading
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import sqlalchemy
from sqlalchemy import event
from sqlmodel import Session, select

from conftest import MODEL_DIR, make_settings, wait_for
from memory_server.auth import list_keys
from memory_server.errors import InvalidInput, NotFound, StartupError, Unavailable
from memory_server.models import ChangeLogEntry, MemoryRecord, new_memory_ids
from memory_server.runtime import Runtime, ensure_bootstrap_key
from memory_server.services.index_sync import RowCache, point_for
from memory_server.storage.db import HeadHint, create_schema, driver_rows, make_engine, placeholders
from memory_server.schemas import AddRequest, SearchRequest, UpdateRequest

FACTS = [
    "Quinn is vegetarian",
    "Quinn's sister lives in Toronto",
    "Quinn started a new job at a bakery in June",
    "Quinn's laptop serial number is XK-55301",
    "Quinn is afraid of flying",
    "Quinn drinks oat milk lattes",
]
QUERIES = ["vegetarian meals", "family in Canada", "XK-55301", "travel by plane", "coffee order"]


def fill(runtime, admin, user="quinn"):
    response = runtime.memories.add_batch(admin, [AddRequest(text=t, user_id=user) for t in FACTS])
    return [r.id for r in response.results]


def answers(runtime, admin, user="quinn", scores=True):
    out = {}
    for query in QUERIES:
        for mode in ("dense", "keyword", "hybrid"):
            hits = runtime.memories.search(admin, SearchRequest(query=query, filters={"user_id": user}, mode=mode))
            out[(query, mode)] = [(h.id, round(h.score, 4)) if scores else h.id for h in hits]
    return out


def test_restart_keeps_memories_history_and_search(settings, embedder, admin):
    first = Runtime.open(settings, embedder=embedder)
    ids = fill(first, admin)
    first.memories.update(admin, ids[0], UpdateRequest(text="Quinn is vegan"))
    before = answers(first, admin)
    first.close()

    second = Runtime.open(settings, embedder=embedder)
    try:
        assert second.memories.get(admin, ids[0]).memory == "Quinn is vegan"
        assert [h.event for h in second.memories.history(admin, ids[0])] == ["ADD", "UPDATE"]
        assert answers(second, admin) == before
        assert second.index.info().points == len(FACTS)
    finally:
        second.close()


def test_a_new_data_directory_is_for_its_owner_only(tmp_path, embedder):
    """It holds every tenant's memories (SQLite's file, the index): a reviewer found it readable by
    every user of the machine (session 27)."""
    settings = make_settings(tmp_path / "new" / "data")
    Runtime.open(settings, embedder=embedder).close()
    assert settings.data_dir.stat().st_mode & 0o777 == 0o700


def test_reopening_an_edge_shard_reads_its_warm_files_ahead_and_leaves_the_cold_ones(settings, embedder, admin,
                                                                                     monkeypatch):
    from memory_server.storage.vectors import edge

    first = Runtime.open(settings, embedder=embedder)
    fill(first, admin)
    first.index.optimize()
    before = answers(first, admin)
    shard = first.index.path
    first.close()

    warm = edge.warm_files(shard)
    every = [f for f in shard.rglob("*") if f.is_file()]
    assert warm and set(warm) < set(every)
    assert any("payload_storage" in f.parts for f in every) and not any("payload_storage" in f.parts for f in warm)

    calls = []
    original = edge.read_ahead

    def spy(path):
        expected = sum(f.stat().st_size for f in edge.warm_files(path))
        calls.append((path, expected, original(path)))
        return calls[-1][2]

    monkeypatch.setattr(edge, "read_ahead", spy)
    second = Runtime.open(settings, embedder=embedder)
    try:
        assert len(calls) == 1 and calls[0][0] == shard and calls[0][1] == calls[0][2] > 0
        assert answers(second, admin) == before
    finally:
        second.close()


def test_opening_reads_the_sqlite_file_ahead_unless_turned_off(settings, embedder, admin, monkeypatch):
    from memory_server import runtime as runtime_module
    from memory_server.storage import db

    first = Runtime.open(settings, embedder=embedder)
    fill(first, admin)
    before = answers(first, admin)
    first.close()
    database = settings.data_dir / "memory.db"

    calls = []
    original = db.warm_sqlite_file

    def spy(engine):
        calls.append(original(engine))
        return calls[-1]

    monkeypatch.setattr(runtime_module, "warm_sqlite_file", spy)
    second = Runtime.open(settings, embedder=embedder)
    try:
        # SQLite: the whole file, read before the runtime answers (PostgreSQL: nothing to read).
        assert calls == ([0] if settings.database_url else [database.stat().st_size])
        assert settings.database_url or calls[0] > 0
        assert answers(second, admin) == before
    finally:
        second.close()
    third = Runtime.open(settings.model_copy(update={"warm_database": False}), embedder=embedder)
    third.close()
    assert len(calls) == 1


def test_warming_the_database_file_leaves_sqlite_locks_of_this_process_in_place(tmp_path, embedder, admin):
    """SQLite's locks are POSIX locks: closing any descriptor of the database file drops every lock
    this process holds on it. Another process that opens the file then believes it is alone: it
    resets the WAL index and, closing, checkpoints and deletes the WAL under this process's open
    connections ("database disk image is malformed", lost writes). The warm-up must not do that."""
    settings = make_settings(tmp_path / "data")
    first = Runtime.open(settings, embedder=embedder)
    first.close()  # a file to warm at the next open
    runtime = Runtime.open(settings, embedder=embedder)
    database = settings.data_dir / "memory.db"
    try:
        ensure_bootstrap_key(runtime.engine, settings.data_dir)  # as the server does: a write in the WAL
        # What `memory-server keys create` does meanwhile: its own connection, a write, a close.
        in_another_process(database, "c.execute('CREATE TABLE elsewhere (x)'); c.execute('INSERT INTO elsewhere VALUES (1)')")
        runtime.memories.add(admin, AddRequest(text="Quinn is vegetarian", user_id="quinn"))
        runtime.memories.add(admin, AddRequest(text="Quinn drinks oat milk lattes", user_id="quinn"))
        hits = runtime.memories.search(admin, SearchRequest(query="coffee order", filters={"user_id": "quinn"}))
        assert hits[0].memory == "Quinn drinks oat milk lattes"
        # Another process sees them (with the WAL deleted under it, this process wrote into a file
        # no one else could open).
        assert in_another_process(database, "print(c.execute('SELECT count(*) FROM memories').fetchone()[0])") == "2"
    finally:
        runtime.close()
    connection = sqlite3.connect(database)
    try:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert {t for (t,) in connection.execute("SELECT text FROM memories")} == {
            "Quinn is vegetarian", "Quinn drinks oat milk lattes"}
        assert connection.execute("SELECT x FROM elsewhere").fetchall() == [(1,)]
    finally:
        connection.close()


def in_another_process(database: Path, code: str) -> str:
    """Run `code` with `c`, an sqlite3 connection to `database`, in a new Python process, as the CLI's
    commands do; commit, close, and return what it printed."""
    script = f"import sqlite3, sys\nc = sqlite3.connect(sys.argv[1])\n{code}\nc.commit()\nc.close()"
    return subprocess.run([sys.executable, "-c", script, str(database)], check=True, timeout=60, capture_output=True,
                          text=True).stdout.strip()


def test_warming_the_database_file_is_for_sqlite_files_that_fit_in_memory(tmp_path):
    from sqlalchemy import create_engine

    from memory_server.storage.db import warm_sqlite_file

    path = tmp_path / "some.db"
    path.write_bytes(b"x" * 10_000)
    engine = create_engine(f"sqlite:///{path}")
    assert warm_sqlite_file(engine, available=1 << 30) == 10_000
    assert warm_sqlite_file(engine, available=19_999) == 0  # more than half of what is available
    assert warm_sqlite_file(create_engine(f"sqlite:///{tmp_path / 'absent.db'}"), available=1 << 30) == 0
    assert warm_sqlite_file(create_engine("sqlite://"), available=1 << 30) == 0
    # PostgreSQL keeps its own cache; nothing is read (and no connection is made).
    assert warm_sqlite_file(create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"), available=1 << 30) == 0


def test_read_ahead_takes_what_loading_reads_and_leaves_full_vectors_and_payloads(tmp_path):
    from memory_server.storage.vectors import edge

    # An indexed segment's layout (too large a store to build in a test): full vectors, their int8
    # copies, the graph, the id tracker and the payloads.
    segment = tmp_path / "segments" / "s1"
    layout = {"vector_storage-dense/matrix.dat": 300, "vector_storage-dense/quantized.data": 70,
              "vector_index-dense/links_compressed.bin": 20, "id_tracker.i2e": 5,
              "payload_storage/page_0.dat": 90, "payload_index/user_id-map/page_0.dat": 9}
    for name, size in layout.items():
        (segment / name).parent.mkdir(parents=True, exist_ok=True)
        (segment / name).write_bytes(b"x" * size)
    warm = {str(f.relative_to(segment)) for f in edge.warm_files(tmp_path)}
    assert warm == {"vector_storage-dense/quantized.data", "vector_index-dense/links_compressed.bin",
                    "id_tracker.i2e", "payload_index/user_id-map/page_0.dat"}
    assert edge.read_ahead(tmp_path) == 70 + 20 + 5 + 9


def test_reindex_from_sql_gives_the_same_search_results(runtime, admin):
    fill(runtime, admin)
    runtime.memories.delete(admin, runtime.memories.list(admin, user_id="quinn").results[0].id)
    # BM25's IDF still counts a deleted point until Qdrant vacuums it, so keyword scores may move
    # after a rebuild; which memories come back, and their order, must not.
    before = answers(runtime, admin, scores=False)
    rebuilt = runtime.sync.rebuild()
    assert rebuilt == len(FACTS) - 1
    assert runtime.index.applied_position() == runtime.sync.head()
    assert answers(runtime, admin, scores=False) == before


def test_reindex_does_not_reembed(runtime, admin, monkeypatch):
    fill(runtime, admin)
    monkeypatch.setattr(runtime.embedder, "embed", lambda texts: pytest.fail("reindex must use stored vectors"))
    assert runtime.sync.rebuild() == len(FACTS)


def test_index_crash_after_sql_commit_is_repaired_on_restart(settings, embedder, admin, monkeypatch):
    first = Runtime.open(settings, embedder=embedder)
    ids = fill(first, admin)

    def crash(*_args, **_kwargs):
        raise RuntimeError("index process died")

    # The SQL transaction commits, then the index fails before applying: the client hears 503.
    for write in ("apply", "upsert", "delete"):
        monkeypatch.setattr(first.index, write, crash)
    with pytest.raises(Unavailable):
        first.memories.add(admin, AddRequest(text="Quinn adopted a kitten named Pixel", user_id="quinn"))
    with pytest.raises(Unavailable):
        first.memories.delete(admin, ids[4])
    monkeypatch.undo()
    first.close()

    second = Runtime.open(settings, embedder=embedder)
    try:
        found = second.memories.search(admin, SearchRequest(query="kitten", filters={"user_id": "quinn"}, mode="keyword"))
        assert [h.memory for h in found] == ["Quinn adopted a kitten named Pixel"]
        flying = second.memories.search(admin, SearchRequest(query="afraid of flying", filters={"user_id": "quinn"}))
        assert ids[4] not in [h.id for h in flying]
        assert second.index.info().points == len(FACTS)  # 6 - 1 deleted + 1 added
        assert second.index.applied_position() == second.sync.head()
    finally:
        second.close()


def test_replaying_the_whole_log_is_idempotent(runtime, admin):
    ids = fill(runtime, admin)
    runtime.memories.update(admin, ids[1], UpdateRequest(text="Quinn's sister moved to Vancouver"))
    runtime.memories.delete(admin, ids[2])
    before = answers(runtime, admin)
    runtime.index.set_applied_position(0)
    assert runtime.sync.catch_up() == runtime.sync.head()
    assert answers(runtime, admin) == before
    assert runtime.index.info().points == len(FACTS) - 1


def test_points_built_by_a_batch_add_equal_the_ones_read_from_sql(runtime, admin):
    # A batch add hands its own points to the index instead of reading its rows back; replaying
    # the log from SQL must give the very same index: scores, payload filters, expiry.
    later = datetime.now(timezone.utc) + timedelta(days=3)
    runtime.memories.add_batch(admin, [
        AddRequest(text=t, user_id="quinn", metadata={"n": i, "pinned": i % 2 == 0, "tags": ["a", f"t{i}"]},
                   expires_at=later if i == 3 else None) for i, t in enumerate(FACTS)])
    filters = [{"user_id": "quinn"}, {"AND": [{"user_id": "quinn"}, {"metadata.pinned": True}]},
               {"AND": [{"user_id": "quinn"}, {"metadata.n": {"gte": 2}}]}, {"AND": [{"user_id": "quinn"}, {"metadata.tags": {"in": ["t4"]}}]}]

    def everything():
        return [[(h.id, round(h.score, 4), h.expires_at) for h in runtime.memories.search(
            admin, SearchRequest(query=q, filters=f, mode=m))]
            for q in QUERIES for f in filters for m in ("dense", "keyword", "hybrid")]

    before = everything()
    assert all(before[3 * f] for f in range(len(filters)))  # every filter matches something (dense, first query)
    runtime.index.set_applied_position(0)
    runtime.sync.catch_up()
    assert everything() == before


def test_a_prepared_point_never_hides_a_later_change(runtime, admin):
    ids = fill(runtime, admin)
    runtime.memories.update(admin, ids[0], UpdateRequest(text="Quinn eats fish now"))
    stale = point_for(SimpleNamespace(id=ids[0], tenant_id=admin.tenant_id, user_id="quinn", agent_id=None,
                                      run_id=None, text=FACTS[0], meta={}, expires_at=None,
                                      embedding=runtime.embedder.embed([FACTS[0]])[0].tobytes(),
                                      created_at=datetime.now(timezone.utc), updated_at=datetime.now(timezone.utc)),
                      runtime.sync.sparse)
    runtime.index.set_applied_position(0)
    # ids[0] has two log entries (add, update): its row as it is now wins over the point built at add time.
    runtime.sync.catch_up({ids[0]: stale})
    found = runtime.memories.search(admin, SearchRequest(query="vegetarian", filters={"user_id": "quinn"}, mode="keyword"))
    assert found == []
    found = runtime.memories.search(admin, SearchRequest(query="fish", filters={"user_id": "quinn"}, mode="keyword"))
    assert [h.id for h in found] == [ids[0]]


def test_an_add_applies_its_own_entries_without_reading_them_back_unless_another_writers_wait(runtime, embedder,
                                                                                            admin, monkeypatch):
    """IndexSync.catch_up's `own`: an add's change-log entries are all its own, so when the index has
    applied everything before them it applies them from the add's points, without reading the log.
    When another writer (a worker, a replica) committed in between, everything is read and applied."""
    reads = []
    real_changes = runtime.sync._changes
    monkeypatch.setattr(runtime.sync, "_changes", lambda connection, entries, prepared: reads.append(
        [(memory_id, op) for _, memory_id, op in entries]) or real_changes(connection, entries, prepared))

    def head():
        with runtime.engine.connect() as connection:
            return driver_rows(connection, "SELECT max(position) FROM change_log")[0][0]

    [mine] = runtime.memories.add(admin, AddRequest(text="Quinn keeps two cats", user_id="quinn")).results
    assert reads == [] and runtime.index.applied_position() == head()
    other = Runtime.open(runtime.settings, embedder=embedder)
    real_check = runtime.memories._stored_near_duplicates
    theirs = []

    def another_writer_commits_meanwhile(*args):  # after this add followed the log, before its commit
        if not theirs:
            theirs.extend(other.memories.add(admin, AddRequest(text="Quinn plays the cello", user_id="rosa")).results)
        return real_check(*args)

    monkeypatch.setattr(runtime.memories, "_stored_near_duplicates", another_writer_commits_meanwhile)
    try:
        [later] = runtime.memories.add(admin, AddRequest(text="Quinn runs marathons", user_id="quinn")).results
    finally:
        other.close()
    assert reads == [[(theirs[0].id, "add"), (later.id, "add")]]  # both, in their order
    assert runtime.index.applied_position() == head()
    for text, user, memory in (("cats", "quinn", mine), ("cello", "rosa", theirs[0]), ("marathons", "quinn", later)):
        found = runtime.memories.search(admin, SearchRequest(query=text, filters={"user_id": user}, mode="keyword"))
        assert [h.id for h in found] == [memory.id]
    assert len(reads) == 1  # the searches had nothing left to apply


def test_one_transaction_writes_row_embedding_and_log_entry(runtime, admin):
    [memory_id] = fill(runtime, admin)[:1]
    with Session(runtime.engine) as session:
        row = session.get(MemoryRecord, memory_id)
        entries = session.exec(select(ChangeLogEntry).where(ChangeLogEntry.memory_id == memory_id)).all()
    stored = np.frombuffer(row.embedding, dtype=np.float32)
    assert stored.shape == (runtime.embedder.dimension,)
    assert np.allclose(stored, runtime.embedder.embed([FACTS[0]])[0], atol=1e-5)
    assert [e.op for e in entries] == ["add"]
    positions = [e.position for e in Session(runtime.engine).exec(select(ChangeLogEntry).order_by(ChangeLogEntry.position))]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)


def test_memory_ids_are_uuid7_in_the_order_they_were_made(runtime, admin):
    """Time-ordered ids keep a batch's rows at the end of the id-keyed indexes (see new_memory_ids)."""
    first = fill(runtime, admin, user="quinn")
    time.sleep(0.002)  # the id's time is in milliseconds
    later = fill(runtime, admin, user="rosa")
    ids = [uuid.UUID(i) for i in first + later]
    assert {(u.version, u.variant) for u in ids} == {(7, uuid.RFC_4122)}
    assert max(first) < min(later)
    made = runtime.memories.get(admin, later[0]).created_at
    assert abs((ids[-1].int >> 80) - made.timestamp() * 1000) < 1000  # the id's 48 bits of Unix milliseconds
    many = new_memory_ids(10_000) + [new_memory_ids(1)[0] for _ in range(100)]
    assert len(set(many)) == len(many)
    assert all(uuid.UUID(i).version == 7 and uuid.UUID(i).variant == uuid.RFC_4122 for i in many)
    assert many[:10_000] == sorted(many[:10_000])  # one batch's ids ascend: its rows append in order
    assert first == sorted(first)
    # Stored and searched like any other id: the same rows come back from SQL and the index.
    found = runtime.memories.search(admin, SearchRequest(query="vegetarian", filters={"user_id": "rosa"}, top_k=1))
    assert [h.id for h in found] == [later[0]]


def test_failed_batch_writes_nothing(runtime, admin):
    items = [AddRequest(text=t, user_id="quinn") for t in FACTS] + [AddRequest(text="   ", user_id="quinn")]
    with pytest.raises(Exception):
        runtime.memories.add_batch(admin, items)
    assert runtime.memories.list(admin, user_id="quinn").results == []
    assert runtime.sync.head() == 0


class TinyEmbedder:
    """Stands in for a different model: only its dimension matters to this test."""

    name = "tiny-test-model"
    dimension = 8

    def embed(self, texts):
        return np.full((len(texts), 8), 8 ** -0.5, dtype=np.float32)

    def embed_ahead(self, texts):
        return iter(self.embed(texts))


@pytest.mark.parametrize("backend", ["edge", "qdrant"])
def test_model_with_another_dimension_is_refused_at_startup(tmp_path, embedder, backend):
    if backend == "qdrant":
        from qdrant_client import QdrantClient

        from memory_server.storage.vectors.qdrant import QdrantServerIndex

        client = QdrantClient(":memory:")
        QdrantServerIndex(client, "memories", embedder.dimension, embedder.name)
        with pytest.raises(StartupError, match="dimension|384"):
            QdrantServerIndex(client, "memories", TinyEmbedder.dimension, TinyEmbedder.name)
        return
    settings = make_settings(tmp_path / "data")
    Runtime.open(settings, embedder=embedder).close()
    with pytest.raises(StartupError, match="384-dimensional"):
        Runtime.open(settings, embedder=TinyEmbedder())


def test_reindex_reembed_switches_models_and_plain_reindex_refuses(tmp_path, embedder, admin):
    settings = make_settings(tmp_path / "data")
    rt = Runtime.open(settings, embedder=embedder)
    fill(rt, admin)
    rt.close()

    tiny = TinyEmbedder()
    rt = Runtime.open(settings, embedder=tiny, recreate_index=True)  # what `memory-server reindex` does
    try:
        with pytest.raises(StartupError, match="--reembed"):
            rt.sync.rebuild()
        assert rt.sync.rebuild(reembed=tiny) == len(FACTS)
        with Session(rt.engine) as session:
            assert {len(r.embedding) for r in session.exec(select(MemoryRecord))} == {4 * tiny.dimension}
    finally:
        rt.close()
    Runtime.open(settings, embedder=tiny).close()  # the new model now starts cleanly
    with pytest.raises(StartupError, match="tiny-test-model"):
        Runtime.open(settings, embedder=embedder)


def test_an_index_of_the_earlier_int8_model_names_the_setting_that_keeps_it(tmp_path, embedder):
    from memory_server.embedding import Embedder

    settings = make_settings(tmp_path / "data")
    Runtime.open(settings, embedder=Embedder(model_dir=MODEL_DIR, quantize="int8-asymmetric")).close()
    with pytest.raises(StartupError, match="start with MEMORY_SERVER_EMBEDDING_QUANTIZE=int8-asymmetric, or run"):
        Runtime.open(settings, embedder=embedder)
    Runtime.open(settings, embedder=Embedder(model_dir=MODEL_DIR, quantize="int8-asymmetric")).close()


def test_onnx_and_torch_backends_give_the_same_vectors(embedder):
    from memory_server.embedding import Embedder

    torch_embedder = Embedder(backend="torch")
    full = Embedder(model_dir=MODEL_DIR, quantize="none")
    texts = ["Quinn drinks oat milk lattes", "我喜欢吃四川火锅", "O-1001 " * 400]
    assert (full.backend, full.name, torch_embedder.name) == ("onnx", "all-MiniLM-L6-v2", "all-MiniLM-L6-v2")
    assert np.abs(full.embed(texts) - torch_embedder.embed(texts)).max() < 1e-5


def test_int8_default_stays_close_to_full_precision_and_is_its_own_model(embedder):
    from memory_server.embedding import Embedder

    full = Embedder(model_dir=MODEL_DIR, quantize="none")
    texts = [f"Quinn fact number {i}: {fact}" for i, fact in enumerate(FACTS)] + ["我喜欢吃四川火锅"]
    assert embedder.name == "all-MiniLM-L6-v2+int8-per-token-w7-sym"  # the index refuses to mix the two (check_model)
    cosine = (embedder.embed(texts) * full.embed(texts)).sum(axis=1)
    # Measured: min 0.9941 (the Chinese text), median 0.9967; every input with its own zero points
    # (int8-asymmetric, below): 0.995 and 0.9978.
    assert cosine.min() > 0.993 and np.median(cosine) > 0.996
    # Activations are quantised per token: a text's vector does not depend on its batch.
    alone = np.concatenate([embedder._encoder.encode([t]) for t in texts])
    assert np.abs(embedder._encoder.encode(texts) - alone).max() < 1e-5
    with pytest.raises(StartupError, match="not available with the torch backend"):
        Embedder(backend="torch", quantize="int8")


def test_the_asymmetric_int8_model_stays_available_under_its_own_name(embedder):
    # Stores embedded before the centred inputs were quantised symmetrically keep working with
    # MEMORY_SERVER_EMBEDDING_QUANTIZE=int8-asymmetric: same name as then, so no re-embedding.
    from memory_server.embedding import Embedder

    asymmetric = Embedder(model_dir=MODEL_DIR, quantize="int8-asymmetric")
    full = Embedder(model_dir=MODEL_DIR, quantize="none")
    assert asymmetric.name == "all-MiniLM-L6-v2+int8-per-token-w7" != embedder.name
    texts = [f"Quinn fact number {i}: {fact}" for i, fact in enumerate(FACTS)] + ["我喜欢吃四川火锅"]
    cosine = (asymmetric.embed(texts) * full.embed(texts)).sum(axis=1)
    assert cosine.min() > 0.994 and np.median(cosine) > 0.997
    assert np.abs(asymmetric.embed(texts) - embedder.embed(texts)).max() > 1e-4  # really the other model


def test_int8_quantises_centred_inputs_symmetrically_and_keeps_zero_points_for_skewed_ones():
    # The calibration (quantize.CALIBRATION) measures each quantised input's skew: MiniLM's six
    # GELU outputs (one per layer, the input of the second feed-forward product) are skewed and keep
    # per-row zero points; the other 30 products of the six layers (Q, K, V, attention output,
    # first feed-forward) take a fixed zero point, applied by ONNX Runtime's kernel itself.
    import onnx

    from memory_server.embedding import BUNDLED_MODEL, onnx_model_files, resolve_model_path

    zero_points = {"int8": {}, "int8-asymmetric": {}}
    for kind, found in zero_points.items():
        model_file, _ = onnx_model_files(resolve_model_path(BUNDLED_MODEL), MODEL_DIR, kind)
        for n in onnx.load(str(model_file)).graph.node:
            if n.op_type == "MatMulIntegerToFloat":
                found[n.input[4]] = found.get(n.input[4], 0) + 1
    assert zero_points["int8"] == {"pt_128_u8": 30, "pt_zero_u8": 6}
    assert zero_points["int8-asymmetric"] == {"pt_zero_u8": 36}


def test_int8_weights_use_seven_bits_so_products_cannot_saturate_without_vnni():
    # Processors without VNNI add pairs of uint8 x int8 products into a saturating int16: with
    # 8-bit weights (255 * 127 * 2) they computed other vectors (cosine 0.961 to full precision on
    # a Zen 3); 255 * 64 * 2 fits.
    import onnx
    from onnx import numpy_helper

    from memory_server.embedding import BUNDLED_MODEL, onnx_model_files, resolve_model_path

    int8_file, _ = onnx_model_files(resolve_model_path(BUNDLED_MODEL), MODEL_DIR, "int8")
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(int8_file)).graph.initializer
               if t.data_type == onnx.TensorProto.INT8]
    assert len(weights) >= 36  # every matrix product of the six layers
    assert min(w.min() for w in weights) >= -64 and max(w.max() for w in weights) <= 64  # 255 * 64 * 2 <= 32767
    assert min(w.min() for w in weights) == -64  # and the seven bits are used


def test_onnx_tokenizer_gives_transformers_ids_without_importing_it(tmp_path):
    # The onnx backend tokenizes with the `tokenizers` library: importing transformers (and torch
    # with it) cost ~3.3 s and ~230 MB at every start.
    from transformers import AutoTokenizer

    from memory_server.embedding import BUNDLED_MODEL, _Tokenizer, resolve_model_path

    path = resolve_model_path(BUNDLED_MODEL)
    reference, ours = AutoTokenizer.from_pretrained(path), _Tokenizer(path, 256)
    texts = FACTS + ["我喜欢吃四川火锅", "Ça va? Naïve café — déjà vu 🙂", "a", "word " * 400, "x" * 3000, "tab\tand\nline"]
    for chunk in (texts[:3], texts[3:9], texts[9:], texts[-3:-2]):
        expected = reference(chunk, padding=True, truncation=True, max_length=256, return_tensors="np")
        got = ours(chunk)
        assert set(got) == set(expected)
        for name in got:
            assert np.array_equal(got[name], expected[name]), (name, chunk)
    script = (f"from pathlib import Path; import sys; from memory_server.runtime import Runtime; "
              f"from memory_server.config import Settings; "
              f"Runtime.open(Settings(data_dir=Path({str(tmp_path / 'data')!r}))).close(); "
              f"print(sorted(m for m in ('torch', 'transformers', 'sentence_transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMORY_SERVER_MODEL_DIR": str(MODEL_DIR), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_model_is_exported_in_a_child_process_the_server_never_holds_torch(tmp_path):
    # A first start exports the model with torch and transformers (~300 MB that a process keeps
    # once it has imported them): that happens in a child process, and a bad model names its cause.

    from memory_server.embedding import Embedder

    script = (f"from pathlib import Path; import sys; from memory_server.embedding import Embedder; "
              f"e = Embedder(model_dir=Path({str(tmp_path / 'models')!r})); "
              f"print(e.embed_query('hello').shape, sorted(m for m in ('torch', 'transformers', 'onnx') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "(384,) []"
    assert sorted(p.suffix for p in (tmp_path / "models").iterdir()) == [".meta", ".onnx", ".onnx"]
    with pytest.raises(StartupError, match=r"could not export the embedding model .*missing-model.* not found"):
        Embedder(str(tmp_path / "missing-model"), model_dir=tmp_path / "other")
    assert not any((tmp_path / "other").glob("*.onnx"))


def test_a_model_without_tokenizer_json_falls_back_to_transformers(tmp_path):
    import shutil

    from memory_server.embedding import BUNDLED_MODEL, _Tokenizer, resolve_model_path

    source = Path(resolve_model_path(BUNDLED_MODEL))
    copy = tmp_path / "model"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("tokenizer.json", "*.safetensors", "*.bin"))
    slow, fast = _Tokenizer(str(copy), 256), _Tokenizer(str(source), 256)
    assert slow._fast is None and fast._fast is not None
    texts = FACTS + ["我喜欢吃四川火锅", "word " * 400]
    got, expected = slow(texts), fast(texts)
    assert set(got) == set(expected) and all(np.array_equal(got[k], expected[k]) for k in got)


def test_vectors_handed_out_ahead_are_the_same_vectors_in_the_same_order(embedder):
    texts = [f"{FACTS[i % len(FACTS)]} (note {i}{'!' * (i % 7)})" for i in range(300)]
    ahead = list(embedder.embed_ahead(texts))
    assert len(ahead) == len(texts)
    assert np.abs(np.stack(ahead) - embedder.embed(texts)).max() < 1e-6


def test_concurrent_small_embeddings_are_batched_and_stay_exact(embedder):
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"Quinn fact number {i}: {FACTS[i % len(FACTS)]}" for i in range(40)]
    alone = embedder._encoder.encode(texts)  # one plain model call, no batcher
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda t: embedder.embed([t])[0], texts))
    assert np.abs(np.stack(together) - alone).max() < 1e-5


def test_model_calls_split_texts_of_very_different_lengths_at_the_cheapest_points():
    from itertools import combinations

    from memory_server.embedding import CALL_TOKENS, calls_by_length

    def cost(lengths, ends):
        starts = [0, *ends[:-1]]
        return sum(CALL_TOKENS + (end - start) * lengths[end - 1] for start, end in zip(starts, ends))

    assert calls_by_length([11] * 6 + [22]) == [6, 7]  # six queries and one message: two calls
    assert calls_by_length([11, 12, 13]) == [3]  # similar lengths: one call
    assert calls_by_length([8] * 4 + [40] * 4 + [200]) == [4, 8, 9]
    assert calls_by_length([]) == [] and calls_by_length([5]) == [1]
    rng = np.random.default_rng(5)
    for _ in range(200):  # the cheapest of every way to cut the sorted texts into runs
        lengths = sorted(rng.integers(1, 256, size=int(rng.integers(1, 9))).tolist())
        every = [[*cut, len(lengths)] for k in range(len(lengths)) for cut in combinations(range(1, len(lengths)), k)]
        assert cost(lengths, calls_by_length(lengths)) == min(cost(lengths, ends) for ends in every)


def test_a_call_of_mixed_lengths_pads_each_part_to_its_own_longest_text_and_keeps_every_vector(embedder):
    encoder = embedder._encoder
    queries = [f"what does {name} drink?" for name in ("Ana", "Bo", "Cy", "Di", "Ed")]
    message = "Quinn said that she moved to Lisbon last May and now works as a nurse at the children's hospital"
    texts = [queries[0], message, *queries[1:]]
    widths = []
    run = encoder._run
    encoder._run = lambda encoded: widths.append(encoded["input_ids"].shape) or run(encoded)
    try:
        parts = list(encoder.encode_parts(texts))
    finally:
        encoder._run = run
    assert [sorted(rows.tolist()) for rows, _ in parts] == [[0, 2, 3, 4, 5], [1]]  # the queries first
    assert widths[0][0] == 5 and widths[0][1] < widths[1][1]  # the queries are not padded to the message
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    assert np.abs(encoder.encode(texts) - alone).max() < 1e-6


def test_the_call_holding_the_earliest_text_runs_first_whatever_its_length(embedder):
    """The micro-batcher lists its callers' texts in arrival order: whoever waited longest is served
    first, a long message before the queries that arrived after it, and queries before a message
    that arrived after them."""
    encoder = embedder._encoder
    queries = [f"what does {name} drink?" for name in ("Ana", "Bo", "Cy", "Di", "Ed")]
    message = "Quinn said that she moved to Lisbon last May and now works as a nurse at the children's hospital"
    for texts, first in (([message, *queries], [0]), ([*queries, message], [0, 1, 2, 3, 4])):
        parts = list(encoder.encode_parts(texts))
        assert len(parts) == 2 and sorted(parts[0][0].tolist()) == first
        out = np.empty((len(texts), embedder.dimension), dtype=np.float32)
        for rows, vectors in parts:
            out[rows] = vectors
        assert np.abs(out - np.stack([encoder.encode([t])[0] for t in texts])).max() < 1e-6


def test_a_query_batched_with_a_long_message_gets_its_vector_before_the_message_is_embedded(embedder):
    import threading
    from concurrent.futures import Future

    from memory_server.embedding import _MicroBatcher

    second_part = threading.Event()

    def encode_parts(texts):  # the real model calls, held between the first and the second
        parts = embedder._encoder.encode_parts(texts)
        yield next(parts)
        second_part.wait(30)
        yield from parts

    batcher = _MicroBatcher(encode_parts, embedder.dimension, workers=0)  # no threads: _embed is called here
    query, message = Future(), Future()
    long_text = "a long message with its conversation before it " * 12
    worker = threading.Thread(target=batcher._embed, args=([(["who keeps bees?"], query), ([long_text], message)],))
    worker.start()
    try:
        vector = query.result(timeout=30)  # while the message's call has not even started
        assert not message.done()
    finally:
        second_part.set()
        worker.join(30)
    assert np.abs(vector[0] - embedder._encoder.encode(["who keeps bees?"])[0]).max() < 1e-6
    assert np.abs(message.result(timeout=30)[0] - embedder._encoder.encode([long_text])[0]).max() < 1e-6


def test_under_load_a_model_call_waits_for_the_texts_still_coming():
    import threading

    from conftest import MODEL_DIR
    from memory_server.embedding import Embedder

    embedder = Embedder(model_dir=MODEL_DIR, wait_ms=3000, threads=1)
    calls = []
    encode_parts = embedder._batcher._encode_parts
    embedder._batcher._encode_parts = lambda texts: calls.append(list(texts)) or encode_parts(texts)
    vectors = {}
    barrier = threading.Barrier(3)

    def request(text, work):  # a request: says its text is coming, works, then embeds it
        with embedder.coming():
            barrier.wait(10)
            time.sleep(work)
            vectors[text] = embedder.embed_query(text)

    started = time.monotonic()
    requests = [threading.Thread(target=request, args=(t, w)) for t, w in
                (("who keeps bees?", 0), ("where does Ana live?", 0.2), ("what does Bo drink?", 0.4))]
    for r in requests:
        r.start()
    for r in requests:
        r.join(30)
    # One call for the three, made once the last text was in, long before the wait's end.
    assert calls == [["who keeps bees?", "where does Ana live?", "what does Bo drink?"]]
    assert time.monotonic() - started < 2.5
    for text, vector in vectors.items():
        assert np.abs(vector - embedder._encoder.encode([text])[0]).max() < 1e-6
    # A request that ends without embedding (a keyword search) stops the wait too.
    def keyword_search():
        with embedder.coming():
            time.sleep(0.3)
    other = threading.Thread(target=keyword_search)
    other.start()
    time.sleep(0.05)
    started = time.monotonic()
    embedder.embed_query("who plays chess?")
    other.join(10)
    assert 0.1 < time.monotonic() - started < 2.5 and calls[-1] == ["who plays chess?"]
    # A lone caller never waits.
    started = time.monotonic()
    with embedder.coming():
        embedder.embed_query("who sails?")
    embedder.embed_query("who climbs?")
    assert time.monotonic() - started < 1.5 and calls[-2:] == [["who sails?"], ["who climbs?"]]
    assert embedder._coming.count == 0


def test_searches_and_adds_say_their_texts_are_coming_and_keyword_searches_do_not(runtime, admin):
    embedder = runtime.embedder
    seen = []
    embed_query, embed_ahead = embedder.embed_query, embedder.embed_ahead
    embedder.embed_query = lambda text: seen.append(("query", embedder._coming.count)) or embed_query(text)
    embedder.embed_ahead = lambda texts: seen.append(("add", embedder._coming.count)) or embed_ahead(texts)
    try:
        runtime.memories.add(admin, AddRequest(text="Rita grows tomatoes", user_id="rita"))
        for mode in ("hybrid", "dense", "keyword"):
            runtime.memories.search(admin, SearchRequest(query="tomatoes", filters={"user_id": "rita"}, mode=mode))
    finally:
        del embedder.embed_query, embedder.embed_ahead
    assert seen == [("add", 1), ("query", 1), ("query", 1)]  # the keyword search embeds nothing
    assert embedder._coming.count == 0


def test_a_failing_model_call_fails_only_the_callers_still_waiting(embedder):
    from concurrent.futures import Future

    from memory_server.embedding import _MicroBatcher

    def encode_parts(texts):
        parts = embedder._encoder.encode_parts(texts)
        yield next(parts)
        raise RuntimeError("the model ran out of memory")

    batcher = _MicroBatcher(encode_parts, embedder.dimension, workers=0)  # no threads: _embed is called here
    query, message = Future(), Future()
    batcher._embed([(["who keeps bees?"], query), (["a long message with its conversation " * 12], message)])
    assert query.result().shape == (1, embedder.dimension)
    with pytest.raises(Unavailable, match="embedding model failed") as failed:  # a 503, retry later
        message.result()
    assert "out of memory" in str(failed.value.__cause__)


def test_a_caller_that_cancels_while_queued_is_left_out_and_the_model_call_goes_on(embedder):
    """A request awaiting its vectors on the event loop may be cancelled (a server stopping):
    asyncio then cancels the Future it awaited. The model's thread must not fail setting it."""
    from memory_server.embedding import _MicroBatcher

    batcher = _MicroBatcher(embedder._encoder.encode_parts, embedder.dimension, workers=0)  # _gather/_embed run here
    gone, kept = batcher.submit(["a query whose request was cancelled"]), batcher.submit(["who keeps bees?"])
    assert gone.cancel()
    batch = batcher._gather()
    assert [texts for texts, _ in batch] == [["who keeps bees?"]]
    assert not kept.cancel()  # running now: too late to cancel
    batcher._embed(batch)
    assert kept.result().shape == (1, embedder.dimension) and gone.cancelled()
    assert not embedder.query_soon("a query a caller may not cancel").cancel()


def test_a_model_call_gathers_at_most_the_gather_size_from_concurrent_callers(embedder):
    """Under load every call is full: its size is what a caller's wait for the model varies by."""
    from memory_server.embedding import _MicroBatcher

    batcher = _MicroBatcher(embedder._encoder.encode_parts, embedder.dimension, max_texts=10, workers=0)
    queries = [f"who keeps bees number {n}?" for n in range(25)]
    pending = [batcher.submit([q]) for q in queries]
    sizes = []
    while not all(p.done() for p in pending):
        batch = batcher._gather()
        sizes.append(sum(len(texts) for texts, _ in batch))
        batcher._embed(batch)
    assert sizes == [10, 10, 5]  # in the order they came
    vectors = np.stack([p.result()[0] for p in pending])
    assert np.abs(vectors - embedder._encoder.encode(queries)).max() < 1e-5


def test_the_gather_size_is_a_setting_apart_from_the_batch_size(tmp_path):
    runtime = Runtime.open(make_settings(tmp_path, model_dir=MODEL_DIR, embedding_gather_size=6, embedding_batch_size=16))
    try:
        assert runtime.embedder._batcher._max_texts == 6 and runtime.embedder.batch_size == 16
    finally:
        runtime.close()
    assert make_settings(tmp_path).embedding_gather_size == 10
    with pytest.raises(ValueError, match="embedding_gather_size"):
        make_settings(tmp_path, embedding_gather_size=0)


def test_texts_handed_to_the_model_early_get_the_vectors_of_the_plain_calls(embedder):
    query, texts = "who keeps bees on a roof?", ["Alice keeps bees", "Bob rides a red bike to work"]
    early = embedder.query_soon(query)
    assert np.abs(early.result() - embedder.embed_query(query)).max() < 1e-6
    assert embedder.query_soon(query).result() is embedder.embed_query(query)  # the cache answers at once
    assert np.abs(embedder.embed_soon(texts).result() - embedder.embed(texts)).max() < 1e-5
    assert embedder.embed_soon([]) is None
    assert embedder.embed_soon(["a text"] * 5) is None  # more than a micro-batch: embed_ahead's work


def test_searches_and_adds_started_early_answer_as_the_plain_calls(runtime, admin):
    memories = runtime.memories
    request = AddRequest(text="Rita grows tomatoes on her balcony", user_id="rita", metadata={"kind": "garden"})
    ahead = memories.add_ahead(admin, request)
    assert ahead.vectors is not None
    added = memories.add(admin, request, ahead)
    assert [r.event for r in added.results] == ["ADD"]
    assert [r.event for r in memories.add(admin, request).results] == ["NOOP"]  # the same fact, the same memory
    for mode in ("hybrid", "dense", "keyword"):
        search = SearchRequest(query="what grows on the balcony", user_id="rita", mode=mode)
        early = memories.search_ahead(admin, search)
        assert (early.query_vector is None) == (mode == "keyword")
        assert memories.search(admin, search, early) == memories.search(admin, search)
    # Refused before anything is embedded.
    with pytest.raises(InvalidInput, match="user_id, agent_id, run_id"):
        memories.add_ahead(admin, AddRequest(text="a fact of no one"))
    with pytest.raises(InvalidInput, match="user_id, agent_id, run_id"):
        memories.search_ahead(admin, SearchRequest(query="whose facts?"))


def test_a_model_failure_is_a_503_whether_the_texts_went_early_or_not(runtime, admin, monkeypatch):
    def out_of_memory(texts):
        raise RuntimeError("the model ran out of memory")
        yield

    monkeypatch.setattr(runtime.embedder._batcher, "_encode_parts", out_of_memory)  # small calls, batched
    monkeypatch.setattr(runtime.embedder._encoder, "encode", lambda texts: next(out_of_memory(texts)))  # large ones
    memories = runtime.memories
    search = SearchRequest(query="a query the cache has never seen", user_id="rita")
    add = AddRequest(text="Rita keeps a fact the model cannot embed", user_id="rita")
    for attempt in (lambda: memories.search(admin, search, memories.search_ahead(admin, search)),
                    lambda: memories.search(admin, search),
                    lambda: memories.add(admin, add, memories.add_ahead(admin, add)),
                    lambda: memories.add(admin, add),
                    lambda: memories.add_batch(admin, [AddRequest(text=f"fact {i}", user_id="rita") for i in range(40)])):
        with pytest.raises(Unavailable, match="embedding model failed"):
            attempt()
    monkeypatch.undo()
    assert memories.list(admin, user_id="rita").results == []  # nothing half-written


def test_a_write_run_on_the_driver_cursor_alone_is_committed(settings):
    """The hot writes read and write through the driver's cursor (driver_rows, RowEncoder), which
    begins no SQLAlchemy transaction: begin_write must, or commit() ends nothing and the pool rolls
    the write back (an add answered ADD and stored nothing)."""
    from memory_server.storage.db import begin_write

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)
    create_schema(engine)
    try:
        with engine.connect() as connection:
            assert driver_rows(connection, "SELECT COUNT(*) FROM change_log") == [(0,)]
            begin_write(connection)
            cursor = connection.connection.cursor()
            cursor.execute("CREATE TABLE notes (text TEXT)")
            cursor.execute(f"INSERT INTO notes VALUES ({placeholders(connection, 1)})", ("kept",))
            cursor.close()
            connection.commit()
        with engine.connect() as connection:
            assert driver_rows(connection, "SELECT text FROM notes") == [("kept",)]
    finally:
        engine.dispose()


def test_a_writer_waiting_for_the_sqlite_write_lock_takes_it_as_soon_as_it_is_free(tmp_path):
    from memory_server.storage.db import BUSY_TIMEOUT_MS, begin_write

    engine = make_engine(f"sqlite:///{tmp_path / 'lock.db'}")
    create_schema(engine)
    holder, waiter = engine.connect(), engine.connect()
    took = threading.Event()
    try:
        begin_write(holder)
        holder.exec_driver_sql("CREATE TABLE notes (text TEXT)")
        thread = threading.Thread(target=lambda: (begin_write(waiter), took.set()))
        thread.start()
        assert not took.wait(0.3)  # the lock is held: it waits
        holder.exec_driver_sql("INSERT INTO notes VALUES ('written first')")
        holder.commit()
        assert took.wait(5)
        thread.join()
        # It reads what the first writer committed, and the busy timeout is back for other statements.
        assert waiter.exec_driver_sql("SELECT text FROM notes").scalar() == "written first"
        assert waiter.exec_driver_sql("PRAGMA busy_timeout").scalar() == BUSY_TIMEOUT_MS
        waiter.rollback()
    finally:
        holder.close()
        waiter.close()
        engine.dispose()


def test_a_writer_gives_up_on_the_sqlite_write_lock_after_the_busy_timeout(tmp_path):
    from memory_server.storage.db import BUSY_TIMEOUT_MS, begin_immediate

    path = tmp_path / "lock.db"
    holder, waiter = sqlite3.connect(path), sqlite3.connect(path)
    try:
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            begin_immediate(waiter, timeout=0.2)
        assert time.monotonic() - started >= 0.2
        assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS
        holder.rollback()
        begin_immediate(waiter)
        with pytest.raises(sqlite3.OperationalError, match="within a transaction"):  # not a busy lock: at once
            begin_immediate(waiter)
        assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS
    finally:
        holder.close()
        waiter.close()


@pytest.mark.parametrize("beside", [True, False], ids=["checkpoints beside", "sqlite's own checkpoints"])
def test_commits_leave_the_wal_checkpoint_to_a_thread_of_its_own(tmp_path, beside):
    from memory_server.storage.db import WalCheckpointer

    path = tmp_path / "wal.db"
    engine = make_engine(f"sqlite:///{path}")
    checkpointer = WalCheckpointer(engine) if beside else None
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("CREATE TABLE blobs (data BLOB)")
            connection.commit()
        if beside:  # the thread copies it at its next interval; nothing else is noted until the next commit
            wait_for(lambda: checkpointer.checkpoints == 1, "the interval's checkpoint", 5)
        empty = path.stat().st_size
        with engine.connect() as connection:  # 1,500 rows, ~1,500 pages: past SQLite's own 1,000
            if beside:
                assert connection.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
            connection.exec_driver_sql("INSERT INTO blobs VALUES (?)", [(os.urandom(4000),)] * 1500)
            connection.commit()
            grown_in_the_commit = path.stat().st_size - empty
        if not beside:  # the commit copied its pages into the database file itself
            assert grown_in_the_commit > 5_000_000
            return
        assert grown_in_the_commit == 0  # they are in the WAL only: the commit did not copy them
        # The thread did, as soon as the connection was back in the pool: well within an interval.
        wait_for(lambda: path.stat().st_size - empty > 5_000_000, "the checkpoint", checkpointer.INTERVAL * 0.8)
        # Small commits (under 500 rows) are copied by the thread too, at its next interval: 300 rows
        # of ~4 pages each take the WAL past 1,000 pages, where SQLite's own checkpoint would have
        # copied them in the commit.
        before = path.stat().st_size
        with Session(engine) as session:
            session.connection().exec_driver_sql("INSERT INTO blobs VALUES (?)", [(os.urandom(14000),)] * 300)
            session.commit()
            assert path.stat().st_size == before
        wait_for(lambda: path.stat().st_size - before > 3_000_000, "the interval's checkpoint", 5)
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM blobs").scalar() == 1800
        checkpoints = checkpointer.checkpoints
        time.sleep(checkpointer.INTERVAL * 3)  # nothing committed: nothing to copy
        assert checkpointer.checkpoints == checkpoints
    finally:
        if checkpointer is not None:
            checkpointer.stop()
            assert not checkpointer._thread.is_alive()
            with engine.connect() as connection:  # stopped: the engine's connections checkpoint as SQLite does
                assert connection.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 1000
        engine.dispose()


def test_a_runtime_checkpoints_sqlite_beside_its_commits_unless_turned_off(tmp_path, embedder, admin, database_url):
    on = Runtime.open(make_settings(tmp_path / "on", database_url), embedder=embedder)
    off = Runtime.open(make_settings(tmp_path / "off", database_url, sqlite_background_checkpoints=False),
                       embedder=embedder)
    try:
        assert off.checkpointer is None
        if database_url is not None:  # PostgreSQL checkpoints itself
            assert on.checkpointer is None
            return
        fill(on, admin)  # a small batch: copied at the thread's next interval
        wait_for(lambda: on.checkpointer.checkpoints >= 1, "the interval's checkpoint", 5)
        for runtime, pages in ((on, 0), (off, 1000)):  # 0: the commits of `on` never checkpoint themselves
            with runtime.engine.connect() as connection:
                assert connection.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == pages
        checkpoints = on.checkpointer.checkpoints
        cities = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Berlin", "Lima", "Hanoi", "Oslo", "Austin", "Cairo"]
        hobbies = ["chess", "pottery", "salsa", "the piano", "watercolour", "tennis", "kayaking", "jazz", "baking",
                   "astronomy", "gardening", "cycling", "knitting", "surfing", "poetry", "climbing", "origami"]
        texts = [f"Member {n} of the {hobby} club moved to {city} in {1990 + n % 30}"
                 for n, (city, hobby) in enumerate((c, h) for c in cities for h in hobbies)]
        added = on.memories.add_batch(admin, [AddRequest(text=t, user_id="quinn") for t in texts])
        assert sum(r.event == "ADD" for r in added.results) >= 170  # ~3 rows each: a large commit
        wait_for(lambda: on.checkpointer.checkpoints > checkpoints, "the checkpoint", 5)
        thread = on.checkpointer._thread
    finally:
        on.close()
        off.close()
    assert not thread.is_alive()


def test_an_update_answers_with_what_it_wrote_when_the_memory_is_deleted_right_after_its_commit(runtime, admin):
    """Between an update's commit and its answer another request may delete the memory: the answer
    is what the update wrote (reading the row back after the commit was a 500)."""
    [added] = runtime.memories.add(admin, AddRequest(text="Quinn keeps bees on the roof", user_id="quinn")).results
    deleted = []

    def delete_after_the_update(session):
        if not deleted:  # once: the delete's own commit comes here too
            deleted.append(added.id)
            runtime.memories.delete(admin, added.id)

    event.listen(Session, "after_commit", delete_after_the_update)
    try:
        answer = runtime.memories.update(admin, added.id, UpdateRequest(text="Quinn keeps bees and hens on the roof"))
    finally:
        event.remove(Session, "after_commit", delete_after_the_update)
    assert deleted == [added.id]
    assert (answer.id, answer.memory) == (added.id, "Quinn keeps bees and hens on the roof")
    assert [(h.event, h.new_memory) for h in runtime.memories.history(admin, added.id)] == [
        ("ADD", "Quinn keeps bees on the roof"), ("UPDATE", "Quinn keeps bees and hens on the roof"), ("DELETE", None)]


def test_processes_starting_at_once_on_a_new_database_create_its_schema_together(database_url, tmp_path):
    """Replicas started together on an empty database all come up (on PostgreSQL all but one used
    to fail: each created the tables the others were creating)."""
    url = database_url or f"sqlite:///{tmp_path / 'memory.db'}"
    engines = [make_engine(url) for _ in range(4)]
    together = threading.Barrier(len(engines))

    def start(engine):
        together.wait()
        create_schema(engine)

    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(start, engines))  # raises what any of them raised
        tables = set(sqlalchemy.inspect(engines[0]).get_table_names())
        assert {MemoryRecord.__tablename__, ChangeLogEntry.__tablename__} <= tables
    finally:
        for engine in engines:
            engine.dispose()


def test_servers_starting_at_once_on_a_new_database_make_one_bootstrap_key(runtime, tmp_path):
    """Replicas (or workers) starting together on an empty database: one admin key, in one file."""
    replicas = [tmp_path / f"replica-{n}" for n in range(6)]
    for directory in replicas:
        directory.mkdir()
    with ThreadPoolExecutor(len(replicas)) as pool:
        made = list(pool.map(lambda directory: ensure_bootstrap_key(runtime.engine, directory), replicas))
    assert sum(path is not None for path in made) == 1
    with Session(runtime.engine) as session:
        assert [key.role for key in list_keys(session)] == ["admin"]


def test_two_processes_on_one_data_dir_hold_their_own_index_and_read_each_others_writes(settings, embedder, admin):
    """What `serve --workers N` relies on: each Runtime claims a free index directory, and a search
    first applies what the other one committed."""
    first = Runtime.open(settings, embedder=embedder)
    second = Runtime.open(settings, embedder=embedder)
    try:
        assert (first.index.info().extra["path"], second.index.info().extra["path"]) == (
            str(settings.data_dir / "index"), str(settings.data_dir / "index-1"))
        [added] = first.memories.add(admin, AddRequest(text="Quinn keeps bees on the roof", user_id="quinn")).results
        search = SearchRequest(query="who keeps bees?", filters={"user_id": "quinn"})
        assert [hit.id for hit in second.memories.search(admin, search)] == [added.id]
        second.memories.update(admin, added.id, UpdateRequest(text="Quinn keeps bees and hens on the roof"))
        assert [hit.memory for hit in first.memories.search(admin, search)] == ["Quinn keeps bees and hens on the roof"]
        with Session(first.engine) as racing:  # `first` holds the write lock: `second`'s delete waits for it
            row = first.memories._locked(racing, admin, added.id)
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(second.memories.delete, admin, added.id)
                time.sleep(0.5)
                assert not waiting.done()
                first.memories._delete_rows(racing, [row], "key_racer")
                racing.commit()
                first.memories._publish()  # as VectorMemory.delete does after its commit
                with pytest.raises(NotFound):  # then reads the row again: gone
                    waiting.result(timeout=30)
        assert first.memories.search(admin, search) == []
        with pytest.raises(NotFound):
            first.memories.delete(admin, added.id)
        history = second.memories.history(admin, added.id)
        assert [(h.event, h.actor) for h in history] == [("ADD", admin.key_id), ("UPDATE", admin.key_id),
                                                         ("DELETE", "key_racer")]
    finally:
        second.close()
        first.close()
    again = Runtime.open(settings, embedder=embedder)  # a closed runtime's directory is free again
    try:
        assert again.index.info().extra["path"] == str(settings.data_dir / "index")
    finally:
        again.close()


def test_model_calls_are_cut_by_texts_and_by_padded_size():
    from memory_server.embedding import CALL_CHARS, _chunks

    texts = ["short memory"] * 100 + ["a long message with its conversation before it " * 20] * 30
    chunks = _chunks(range(len(texts)), texts, 64)
    assert [i for chunk in chunks for i in chunk] == list(range(len(texts)))  # every text once, in order
    assert max(len(chunk) for chunk in chunks) == 64
    long_chunks = [chunk for chunk in chunks if chunk[0] >= 100]
    assert long_chunks and all(len(c) * min(len(texts[c[0]]), 1500) <= CALL_CHARS for c in long_chunks)
    assert _chunks([], texts, 64) == []


def test_schema_check_adds_new_indexes_and_drops_superseded_ones(settings):
    # Databases made by an earlier version get the indexes added since, and lose the ones replaced.
    from sqlalchemy import inspect, text

    from memory_server.runtime import open_database
    from memory_server.storage.db import SUPERSEDED_INDEXES

    engine = open_database(settings)
    try:
        with engine.begin() as connection:  # as the previous version left it
            connection.execute(text("DROP INDEX ix_memories_hash_scope"))
            connection.execute(text("CREATE INDEX ix_memories_hash ON memories (tenant_id, hash)"))
        create_schema(engine)
        create_schema(engine)  # and again: nothing left to do
        names = {i["name"] for i in inspect(engine).get_indexes("memories")}
        assert "ix_memories_hash_scope" in names and not names & set(SUPERSEDED_INDEXES)
    finally:
        engine.dispose()


def _as_made_before_the_scope_field(index) -> None:
    """Turn an index into one an earlier version made: points without "scope", meta without "layout"."""
    import qdrant_edge as qe

    from memory_server.storage.vectors.edge import META_ID

    shard = index._shard
    points = [p for p in shard.retrieve([p.id for p in shard.scroll(qe.ScrollRequest(limit=1000))[0]], True, False)
              if p.id != META_ID]
    shard.update(qe.UpdateOperation.delete_payload([p.id for p in points], ["scope"]))
    shard.update(qe.UpdateOperation.upsert_points([qe.Point(META_ID, {}, {
        "_meta": True, "position": index.applied_position(), "dimension": index.dimension, "model": index.model})]))
    shard.flush()


def test_an_index_made_before_the_scope_field_is_rebuilt_at_start(settings, embedder, admin, caplog):
    # Near-duplicates are looked up by the points' "scope" keyword; an index made by an earlier
    # version lacks it, and would let every paraphrase of an old memory in as a new one.
    first = Runtime.open(settings, embedder=embedder)
    ids = fill(first, admin)
    _as_made_before_the_scope_field(first.index)
    first.close()

    second = Runtime.open(settings, embedder=embedder)
    try:
        assert "rebuilding it from SQL" in caplog.text and not second.index.outdated
        again = second.memories.add(admin, AddRequest(text="Quinn is a vegetarian", user_id="quinn")).results[0]
        assert (again.event, again.id) == ("NOOP", ids[0])
        assert second.index.info().points == len(FACTS)
    finally:
        second.close()
    third = Runtime.open(settings, embedder=embedder)  # rebuilt once, not at every start
    third.close()
    assert caplog.text.count("rebuilding it from SQL") == 1


def test_a_qdrant_collection_made_before_the_scope_field_asks_for_reindex(tmp_path, embedder):
    from qdrant_client import QdrantClient, models

    from memory_server.runtime import _rebuild_outdated
    from memory_server.services.index_sync import IndexSync
    from memory_server.storage.vectors.edge import META_ID
    from memory_server.storage.vectors.qdrant import QdrantServerIndex
    from memory_server.storage.vectors.sparse import SparseEncoder

    client = QdrantClient(":memory:")
    index = QdrantServerIndex(client, "memories", embedder.dimension, embedder.name)
    assert not index.outdated
    client.upsert("memories", [models.PointStruct(id=META_ID, vector={}, payload={
        "_meta": True, "position": 0, "dimension": embedder.dimension, "model": embedder.name})], wait=True)
    index = QdrantServerIndex(client, "memories", embedder.dimension, embedder.name)
    assert index.outdated
    settings = make_settings(tmp_path / "data", qdrant_url=":memory:")
    with pytest.raises(StartupError, match="run `memory-server reindex` once"):
        _rebuild_outdated(settings, index, IndexSync(None, index, SparseEncoder()))


def test_rows_encoded_ahead_are_stored_as_sqlalchemys_own_insert_stores_them(runtime):
    # A batch add inserts values converted as its rows were made (RowEncoder), with its creation
    # time given at the insert: read back, every column is what SQLAlchemy's insert stores.
    from memory_server.storage.db import RowEncoder

    table = MemoryRecord.__table__
    encoder = RowEncoder(runtime.engine, table, late=("created_at", "updated_at"))
    made = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=timezone.utc)
    later = datetime(2026, 3, 4, 12, 0, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    ids = new_memory_ids(2)
    rows = [{"id": memory_id, "tenant_id": "t1", "user_id": "zoë", "agent_id": None, "run_id": "r-1",
             "text": "Zoë's \"café\" order: 2× flat white", "context": None, "hash": "0" * 32,
             "metadata": {"tags": ["a", "ü"], "n": 1.5, "nested": {"ok": True, "none": None}},
             "embedding": np.arange(384, dtype=np.float32).tobytes(), "created_at": made, "updated_at": made,
             "expires_at": later} for memory_id in ids]
    with runtime.engine.connect() as connection:
        connection.execute(table.insert(), rows[:1])
        encoder.insert(connection, [encoder.encode({**rows[1], "created_at": None})], created_at=made, updated_at=made)
        connection.commit()
    with Session(runtime.engine) as session:
        stored = {row.id: row.model_dump() for row in session.exec(select(MemoryRecord).where(MemoryRecord.id.in_(ids)))}
    first, second = ({k: v for k, v in stored[i].items() if k != "id"} for i in ids)
    assert first == second
    with runtime.engine.connect() as connection:  # as stored, too: SQL compares times as stored
        raw = [driver_rows(connection, f"SELECT * FROM memories WHERE id = {placeholders(connection, 1)}", (i,))[0][1:]
               for i in ids]
    assert raw[0] == raw[1]
    assert second["created_at"] == made and second["expires_at"] == later and second["meta"] == rows[0]["metadata"]


def test_cached_hit_rows_follow_every_change_whichever_process_made_it(settings, embedder, admin):
    """Both processes keep the rows of their searches' hits (RowCache): a change made through the
    other process (text, metadata, expiry, a delete, a scope delete) is what the next search of
    each one returns, and a row kept for one tenant is never another's."""
    first = Runtime.open(settings, embedder=embedder)
    second = Runtime.open(settings, embedder=embedder)
    search = SearchRequest(query="who keeps bees?", filters={"user_id": "quinn"})

    def seen(runtime, request=search):
        return [(hit.memory, hit.metadata, hit.expires_at) for hit in runtime.memories.search(admin, request)]

    try:
        [added] = first.memories.add(admin, AddRequest(text="Quinn keeps bees on the roof", user_id="quinn",
                                                      metadata={"topic": "garden"})).results
        for runtime in (first, second):
            assert seen(runtime) == [("Quinn keeps bees on the roof", {"topic": "garden"}, None)]
            assert added.id in runtime.sync.rows.get([added.id])[0]  # kept by the search
        second.memories.update(admin, added.id, UpdateRequest(text="Quinn keeps bees and hens on the roof",
                                                               metadata={"topic": "farm"}))
        assert seen(first) == seen(second) == [("Quinn keeps bees and hens on the roof", {"topic": "farm"}, None)]
        soon = datetime.now(timezone.utc) + timedelta(seconds=1.5)
        first.memories.update(admin, added.id, UpdateRequest(expires_at=soon))
        assert [expires for _, _, expires in seen(second)] == [soon]
        time.sleep(1.6)  # expired: left out although its row is kept and no sweep ran
        assert seen(first) == seen(second) == []

        [other] = second.memories.add(admin, AddRequest(text="Quinn keeps bees in the orchard", user_id="quinn")).results
        assert [hit.id for hit in first.memories.search(admin, search)] == [other.id]
        first.memories.delete(admin, other.id)
        assert seen(second) == []
        [third] = first.memories.add(admin, AddRequest(text="Quinn sells the bees' honey", user_id="quinn")).results
        assert [hit.id for hit in second.memories.search(admin, search)] == [third.id]
        first.memories.delete_scope(admin, user_id="quinn")
        assert seen(second) == seen(first) == []

        # A row kept after one tenant's search answers no other tenant's search.
        [kept] = first.memories.add(admin, AddRequest(text="Quinn keeps bees again", user_id="quinn")).results
        assert [hit.id for hit in first.memories.search(admin, search)] == [kept.id]
        stranger = dataclasses.replace(admin, tenant_id="someone-else", key_id="key_stranger")
        assert first.memories.search(stranger, search) == []
    finally:
        second.close()
        first.close()



def test_a_search_asks_the_database_for_changes_only_once_another_process_has_applied_one(settings, embedder, admin):
    """With SQLite the processes share the change log's head as far as they applied it (HeadHint):
    a search reads it instead of the database, and still sees every write another process answered
    before it began (adds, updates, deletes). With PostgreSQL every search asks the database."""
    first = Runtime.open(settings, embedder=embedder)
    second = Runtime.open(settings, embedder=embedder)
    asked = []
    for runtime in (first, second):
        head = runtime.sync.head
        runtime.sync.head = lambda head=head: asked.append(1) or head()
    search = SearchRequest(query="who keeps bees?", filters={"user_id": "quinn"})
    try:
        if settings.database_url:
            assert first.sync.hint is None and second.sync.hint is None
        else:
            assert first.sync.hint.path == second.sync.hint.path == str((settings.data_dir / "memory.db").resolve()) + "-head"
        for n in range(5):
            [added] = first.memories.add(admin, AddRequest(text=f"Quinn keeps {n + 2} hives of bees", user_id="quinn")).results
            assert added.id in [hit.id for hit in second.memories.search(admin, search)]
            second.memories.update(admin, added.id, UpdateRequest(text=f"Quinn keeps {n + 2} hives of bees and hens"))
            assert f"Quinn keeps {n + 2} hives of bees and hens" in [hit.memory for hit in first.memories.search(admin, search)]
            second.memories.delete(admin, added.id)
            assert added.id not in [hit.id for hit in first.memories.search(admin, search)]
        if settings.database_url:
            assert len(asked) >= 10  # one question a search
        else:
            assert asked == []  # no search asked the database where the hint stood
            assert first.sync.hint.read() == second.sync.hint.read() == first.index.applied_position() > 0
            applied = []  # a search with nothing new applies nothing
            catch_up = second.sync.catch_up
            second.sync.catch_up = lambda *a: applied.append(1) or catch_up(*a)
            second.memories.search(admin, search)
            assert applied == []
    finally:
        second.close()
        first.close()


def test_the_head_hint_only_rises_and_every_process_sees_the_highest_published(tmp_path):
    """Processes publishing at once leave the highest of their positions (the file is locked for
    each publish); a lower one never replaces a higher; a new hint on the same file reads it."""
    path = str(tmp_path / "memory.db-head")
    hint = HeadHint(path)
    try:
        assert hint.read() == 0
        hint.publish(7)
        hint.publish(5)
        assert hint.read() == 7
        script = ("import sys\nfrom memory_server.storage.db import HeadHint\nh = HeadHint(sys.argv[1])\n"
                  "for p in range(int(sys.argv[2]), 20000, 3): h.publish(p)\n")
        workers = [subprocess.Popen([sys.executable, "-c", script, path, str(start)]) for start in (0, 1, 2)]
        assert [w.wait(60) for w in workers] == [0, 0, 0]
        assert hint.read() == HeadHint(path).read() == 19999
    finally:
        hint.close()
    # Nothing to share: an in-memory database; PostgreSQL, whose replicas run on other machines.
    for url in ("sqlite://", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"):
        engine = sqlalchemy.create_engine(url)  # not connected
        assert HeadHint.beside(engine) is None
        engine.dispose()


def test_a_shared_word_counts_every_addition_of_every_process(tmp_path):
    """The key cache's revocation count (auth.KeyCache): processes adding at once lose none of
    their additions, and a process that mapped the word before sees them without mapping it again."""
    from memory_server.storage.shared_word import SharedWord

    path = tmp_path / "revocations-count"
    word = SharedWord(path)
    try:
        assert word.read() == 0 and word.add() == 1
        script = ("import sys\nfrom memory_server.storage.shared_word import SharedWord\nw = SharedWord(sys.argv[1])\n"
                  "for _ in range(3000): w.add()\n")
        workers = [subprocess.Popen([sys.executable, "-c", script, str(path)]) for _ in range(3)]
        assert [w.wait(60) for w in workers] == [0, 0, 0]
        assert word.read() == SharedWord(path).read() == 9001
    finally:
        word.close()
    assert SharedWord.open(tmp_path / "no-such-directory" / "count", "nothing") is None  # logged, not raised

def test_the_row_cache_keeps_no_row_read_across_its_change_and_stays_within_its_bytes(monkeypatch):
    """A row read while a change to it was applied may be the row from before it (the read began
    before the commit): it is not kept; rows no change touched meanwhile are. Past its bytes the
    least recently used rows go first."""
    cache = RowCache(max_bytes=3 * (RowCache.OVERHEAD + 10))
    row = lambda memory_id, text="x" * 8: (memory_id, text)  # noqa: E731 -- 10 characters of strings
    found, generation = cache.get(["a", "b"])
    assert found == {}
    cache.forget(["b"])  # a change to b meanwhile: b's read is not kept, a's is
    cache.forget(["z"])
    cache.put([row("a"), row("b", "old text")], generation)
    assert set(cache.get(["a", "b"])[0]) == {"a"}
    _, generation = cache.get(["b"])
    cache.forget()  # everything changed (a rebuild): nothing read before it is kept
    cache.put([row("b")], generation)
    assert len(cache) == 0
    monkeypatch.setattr(RowCache, "RECENT", 2)
    cache = RowCache(max_bytes=3 * (RowCache.OVERHEAD + 10))
    _, generation = cache.get(["a"])
    for other in ("x", "y", "z"):  # more changes than it remembers: it cannot tell a's apart
        cache.forget([other])
    cache.put([row("a")], generation)
    assert len(cache) == 0

    _, generation = cache.get([])
    cache.put([row("a"), row("b")], generation)
    assert set(cache.get(["a", "b"])[0]) == {"a", "b"}
    cache.get(["a"])  # a was used last: b goes first
    _, generation = cache.get([])
    cache.put([row("c"), row("d")], generation)
    assert set(cache.get(["a", "b", "c", "d"])[0]) == {"a", "c", "d"} and len(cache) == 3
    cache.forget(["a"])
    assert set(cache.get(["a", "c", "d"])[0]) == {"c", "d"}
    off = RowCache(max_bytes=0)
    off.put([row("a")], off.get(["a"])[1])
    assert len(off) == 0


def test_the_index_is_optimized_once_requests_leave_it_alone_or_once_too_many_changes_wait(tmp_path, embedder,
                                                                                          admin):
    """Qdrant Edge holds the interpreter's lock through an optimisation, and every request of the
    process waits for it: the maintenance thread optimizes after `index_optimize_every` changes only
    once no request has used the index for `index_optimize_idle_seconds`, unless
    `index_optimize_deferred_max` changes are waiting."""
    settings = make_settings(tmp_path / "data", sync_interval_seconds=0.1, index_optimize_every=100,
                             index_optimize_idle_seconds=1.0, index_optimize_deferred_max=400)
    rt = Runtime.open(settings, embedder=embedder, background=True)
    optimized = []  # when each optimisation began
    optimize = rt.index.optimize
    rt.index.optimize = lambda: (optimized.append(time.monotonic()), optimize())[1]
    search = SearchRequest(query="what does Quinn drink", filters={"user_id": "quinn"})

    def busy(seconds: float) -> None:
        """Searches one after another for `seconds` (each one uses the index)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rt.memories.search(admin, search)
            time.sleep(0.05)

    try:
        rt.memories.add_batch(admin, [AddRequest(text=f"Quinn's note number {i}", user_id="quinn") for i in range(150)])
        busy(2.5)  # 150 changes wait, but requests keep coming: no optimisation yet
        assert optimized == [] and rt.sync.applied_since_optimize == 150
        quiet_from = time.monotonic()
        wait_for(lambda: optimized, "the optimisation once requests stopped", timeout=10)
        assert optimized[0] - quiet_from >= 0.9  # not before the index was left alone for the idle time
        assert rt.sync.applied_since_optimize == 0

        rt.memories.add_batch(admin, [AddRequest(text=f"Quinn's later note {i}", user_id="quinn") for i in range(450)])
        start = time.monotonic()
        busy(1.5)  # past the deferred maximum: optimized even though requests keep coming
        assert len(optimized) == 2 and optimized[1] - start < 1.0
        assert [h.memory for h in rt.memories.search(admin, SearchRequest(
            query="Quinn's later note 7", filters={"user_id": "quinn"}, mode="keyword", top_k=1))] == ["Quinn's later note 7"]
    finally:
        rt.close()
