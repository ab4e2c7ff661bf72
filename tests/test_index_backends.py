"""One contract for both VectorIndex backends (Qdrant Edge, Qdrant server via qdrant-client),
and a congruence check: the same data gives the same ids in the same order on both."""

from contextlib import closing
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from conftest import make_settings
from memory_server.models import ChangeLogEntry, MemoryRecord
from memory_server.runtime import Runtime
from memory_server.schemas import AddRequest, SearchRequest, UpdateRequest
from memory_server.storage.vectors import IndexPoint, IndexQuery, SparseVector
from memory_server.storage.vectors.filters import All, Any_, Field, Not
from memory_server.storage.vectors.qdrant import QdrantServerIndex

BACKENDS = {"edge": None, "qdrant": ":memory:"}  # ":memory:" = qdrant-client's in-process stand-in server

CORPUS = [
    ("u1", "a1", "Rosa grows basil and mint on her balcony", {"topic": "garden", "n": 1}),
    ("u1", "a1", "Rosa's flight to Lima leaves on Friday", {"topic": "travel", "n": 2}),
    ("u1", "a2", "Rosa's passport number is P-884213", {"topic": "travel", "n": 3}),
    ("u1", "a2", "Rosa prefers aisle seats on long flights", {"topic": "travel", "n": 4}),
    ("u1", None, "Rosa is training for a half marathon", {"topic": "sport", "n": 5}),
    ("u2", "a1", "Sam grows tomatoes in a greenhouse", {"topic": "garden", "n": 6}),
    ("u2", "a1", "Sam's flight to Oslo was cancelled", {"topic": "travel", "n": 7}),
    ("u2", None, "山姆喜欢在周末去爬山", {"topic": "sport", "n": 8}),
    ("u1", None, "罗莎下个月要去成都吃火锅", {"topic": "food", "n": 9}),
]
SEARCHES = [
    ("gardening plants", {"user_id": "u1"}),
    ("flight travel plans", {"user_id": "u1"}),
    ("P-884213", {"user_id": "u1"}),
    ("flight", {"agent_id": "a1"}),
    ("travel", {"AND": [{"user_id": "u1"}, {"metadata.topic": "travel"}, {"metadata.n": {"gte": 3}}]}),
    ("plants", {"OR": [{"user_id": "u2"}, {"agent_id": "a2"}]}),
    ("running", {"user_id": "u1", "NOT": [{"agent_id": {"in": ["a1", "a2"]}}]}),
    ("火锅", {"user_id": "u1"}),
    ("爬山", {"user_id": {"in": ["u1", "u2"]}}),
]


@pytest.fixture(params=list(BACKENDS))
def backend_runtime(request, tmp_path, embedder):
    rt = Runtime.open(make_settings(tmp_path / request.param, qdrant_url=BACKENDS[request.param]), embedder=embedder)
    yield rt
    rt.close()


def load(runtime, admin):
    items = [AddRequest(text=t, user_id=u, agent_id=a, metadata=m) for u, a, t, m in CORPUS]
    return [r.id for r in runtime.memories.add_batch(admin, items).results]


def run_searches(runtime, admin):
    out = {}
    for query, filters in SEARCHES:
        for mode in ("dense", "keyword", "hybrid"):
            hits = runtime.memories.search(admin, SearchRequest(query=query, filters=filters, mode=mode, top_k=10))
            out[(query, str(filters), mode)] = [h.memory for h in hits]
    return out


def test_contract_filters_and_modes(backend_runtime, admin):
    load(backend_runtime, admin)
    results = run_searches(backend_runtime, admin)
    assert results[("P-884213", "{'user_id': 'u1'}", "keyword")] == ["Rosa's passport number is P-884213"]
    travel = results[("travel", str(SEARCHES[4][1]), "dense")]
    assert set(travel) == {"Rosa's passport number is P-884213", "Rosa prefers aisle seats on long flights"}
    plants = results[("plants", str(SEARCHES[5][1]), "dense")]
    assert set(plants) == {t for u, a, t, _ in CORPUS if u == "u2" or a == "a2"}
    running = results[("running", str(SEARCHES[6][1]), "dense")]
    assert set(running) == {"Rosa is training for a half marathon", "罗莎下个月要去成都吃火锅"}
    assert results[("火锅", "{'user_id': 'u1'}", "keyword")] == ["罗莎下个月要去成都吃火锅"]
    assert results[("爬山", str(SEARCHES[8][1]), "keyword")] == ["山姆喜欢在周末去爬山"]


def test_contract_update_and_delete_reach_the_index(backend_runtime, admin):
    ids = load(backend_runtime, admin)
    backend_runtime.memories.update(admin, ids[0], UpdateRequest(text="Rosa keeps bees in the garden"))
    backend_runtime.memories.delete(admin, ids[5])
    hits = backend_runtime.memories.search(admin, SearchRequest(query="bees", filters={"user_id": "u1"}, mode="keyword"))
    assert [h.id for h in hits] == [ids[0]]
    sam = backend_runtime.memories.search(admin, SearchRequest(query="tomatoes", filters={"user_id": "u2"}))
    assert ids[5] not in [h.id for h in sam]
    assert backend_runtime.index.info().points == len(CORPUS) - 1


def test_contract_position_is_recorded_and_reset_clears(backend_runtime, admin):
    load(backend_runtime, admin)
    index = backend_runtime.index
    assert index.applied_position() == backend_runtime.sync.head() > 0
    index.reset()
    assert index.applied_position() == 0 and index.info().points == 0


def test_contract_upsert_is_idempotent_and_tenant_is_always_filtered(backend_runtime):
    index = backend_runtime.index
    vector = [1.0] + [0.0] * (index.dimension - 1)
    point = IndexPoint("7d9f1c8e-0000-4000-8000-000000000001", vector, SparseVector([11], [1.0]),
                       {"tenant": "tA", "user_id": "u", "agent_id": "", "run_id": "", "metadata": {}})
    index.upsert([point])
    index.upsert([point])
    query = IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "tA"),)), limit=5, dense=vector)
    assert [h.id for h in index.search(query)] == [point.id]
    other = IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "tB"),)), limit=5, dense=vector)
    assert index.search(other) == []
    negated = IndexQuery(mode="keyword", filter=All((Field("tenant", "eq", "tA"), Not(Any_((Field("user_id", "eq", "u"),))))),
                         limit=5, sparse=SparseVector([11], [1.0]))
    assert index.search(negated) == []


def test_contract_search_batch_answers_each_query_as_search_would(backend_runtime, admin, embedder):
    load(backend_runtime, admin)
    index, sparse = backend_runtime.index, backend_runtime.sync.sparse
    tenant = All((Field("tenant", "eq", admin.tenant_id), Field("user_id", "eq", "u1")))
    queries = [
        IndexQuery(mode="dense", filter=tenant, limit=3, dense=embedder.embed_query("balcony herbs").tolist()),
        IndexQuery(mode="keyword", filter=tenant, limit=3, sparse=sparse.query("the")),  # no searchable terms
        IndexQuery(mode="keyword", filter=tenant, limit=3, sparse=sparse.query("passport")),
        IndexQuery(mode="hybrid", filter=tenant, limit=3, dense=embedder.embed_query("flight").tolist(),
                   sparse=sparse.query("flight"), rrf_k=2),
        IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "someone-else"),)), limit=3,
                   dense=embedder.embed_query("flight").tolist()),
    ]
    batched = index.search_batch(queries)
    # Equal fused scores come back in either order (the service orders ties by id).
    ranked = lambda hits: sorted((-round(h.score, 6), h.id) for h in hits)  # noqa: E731
    assert [ranked(hits) for hits in batched] == [ranked(index.search(q)) for q in queries]
    assert len(batched[0]) == 3 and batched[1] == [] and len(batched[2]) == 1 and batched[4] == []
    assert index.search_batch([]) == []
    # min_score (the dedup check's): only the dense hits at least that close, in one batch as alone.
    plain = queries[0]
    cut = (batched[0][0].score + batched[0][1].score) / 2
    close = replace(plain, min_score=cut)
    assert [h.id for h in index.search(close)] == [batched[0][0].id]
    assert [[h.id for h in hits] for hits in index.search_batch([close, plain])] == [
        [batched[0][0].id], [h.id for h in batched[0]]]


def test_edge_and_qdrant_server_return_the_same_ids_in_the_same_order(tmp_path, embedder, admin):
    """One SQL database, two indexes fed from its change log (as two replicas would be)."""
    from qdrant_client import QdrantClient

    from memory_server.services.index_sync import IndexSync
    from memory_server.services.vector_memory import VectorMemory
    from memory_server.storage.vectors.qdrant import QdrantServerIndex

    rt = Runtime.open(make_settings(tmp_path / "edge"), embedder=embedder)
    qdrant_index = QdrantServerIndex(QdrantClient(":memory:"), "memories", embedder.dimension, embedder.name)
    try:
        ids = load(rt, admin)
        rt.memories.update(admin, ids[1], UpdateRequest(text="Rosa's flight to Lima moved to Saturday"))
        rt.memories.delete(admin, ids[6])
        qdrant_sync = IndexSync(rt.engine, qdrant_index, rt.sync.sparse)
        assert qdrant_sync.catch_up() == rt.sync.head()
        on_qdrant = VectorMemory(rt.settings, rt.engine, embedder, qdrant_index, qdrant_sync, rt.sync.sparse)
        for query, filters in SEARCHES:
            for mode in ("dense", "keyword", "hybrid"):
                request = SearchRequest(query=query, filters=filters, mode=mode, top_k=5)
                edge_hits = rt.memories.search(admin, request)
                qdrant_hits = on_qdrant.search(admin, request)
                assert [h.id for h in edge_hits] == [h.id for h in qdrant_hits], (query, filters, mode)
                if mode != "keyword":  # the two count BM25's documents differently (empty keyword vectors)
                    assert [h.score for h in edge_hits] == pytest.approx([h.score for h in qdrant_hits], abs=1e-4)
    finally:
        qdrant_index.close()
        rt.close()


def test_deleted_memories_rank_keyword_searches_as_if_never_stored(backend_runtime, admin):
    """The process that deleted memories kept their terms in BM25's document frequencies (Qdrant
    Edge's segment in memory), so "alpha beta" ranked "beta" first there and "alpha" first on a
    replica, after a restart or a reindex. (A reviewer's finding, session 27.)"""
    memories = backend_runtime.memories
    kept = ["alpha", "beta", "beta gamma", "beta delta", "filler one", "filler two", "filler three"]
    doomed = ["alpha epsilon", "alpha zeta", "alpha eta", "alpha theta", "alpha iota"]
    added = memories.add_batch(admin, [AddRequest(text=t, user_id="u") for t in kept + doomed]).results
    for result in added[len(kept):]:
        memories.delete(admin, result.id)

    def ranking():
        out = {}
        for mode in ("keyword", "hybrid"):
            hits = memories.search(admin, SearchRequest(query="alpha beta", user_id="u", mode=mode, top_k=4))
            out[mode] = [(h.memory, round(h.score, 4)) for h in hits]
        return out

    live = ranking()
    assert live["keyword"][0][0] == "alpha" and live["hybrid"][0][0] == "alpha"
    backend_runtime.sync.rebuild()  # an index that never held the deleted memories
    assert ranking() == live


def test_an_index_says_when_it_may_hold_expired_points(backend_runtime, admin):
    index, memories = backend_runtime.index, backend_runtime.memories
    now = datetime.now(timezone.utc)
    if isinstance(index, QdrantServerIndex):
        # A shared Qdrant collection is written by every process: this one can never be sure.
        assert index.may_hold_expired(now.timestamp())
        return
    assert not index.may_hold_expired(now.timestamp())  # empty
    later = memories.add(admin, AddRequest(text="Lou's parking permit", user_id="lou",
                                           expires_at=now + timedelta(seconds=60))).results[0].id
    memories.add(admin, AddRequest(text="Lou likes jazz", user_id="lou"))
    assert not index.may_hold_expired(now.timestamp())
    assert index.may_hold_expired((now + timedelta(seconds=61)).timestamp())
    sooner = memories.add(admin, AddRequest(text="Lou's guest pass", user_id="lou",
                                            expires_at=now + timedelta(seconds=30))).results[0].id
    assert index.may_hold_expired((now + timedelta(seconds=31)).timestamp())
    memories.delete(admin, sooner)  # gone: only the 60-s one is left to expire
    assert not index.may_hold_expired((now + timedelta(seconds=31)).timestamp())
    memories.update(admin, later, UpdateRequest(expires_at=None))  # never expires now
    assert not index.may_hold_expired((now + timedelta(seconds=61)).timestamp())
    assert not index.may_hold_expired(datetime(9000, 1, 1, tzinfo=timezone.utc).timestamp())


def test_an_edge_index_that_cannot_tell_keeps_the_expiry_condition(runtime):
    class ShardWithoutOrderedScroll:  # as if the shard had no range index on expires_at
        def __init__(self, shard):
            self.shard = shard

        def scroll(self, request):
            raise RuntimeError("no range index for order_by")

        def __getattr__(self, name):
            return getattr(self.shard, name)

    index = runtime.index
    real, index._earliest_expiry = index._shard, None
    index._shard = ShardWithoutOrderedScroll(real)
    try:
        assert index.may_hold_expired(datetime.now(timezone.utc).timestamp())
    finally:
        index._shard = real
    index._earliest_expiry = None
    assert not index.may_hold_expired(datetime.now(timezone.utc).timestamp())  # empty, and it can tell again


def test_contract_apply_writes_points_then_deletes_then_position(backend_runtime):
    index = backend_runtime.index
    vector = [1.0] + [0.0] * (index.dimension - 1)
    payload = {"tenant": "tA", "user_id": "u", "agent_id": "", "run_id": "", "metadata": {}, "expires_at": 4e9}
    ids = [f"7d9f1c8e-0000-4000-8000-00000000000{n}" for n in (1, 2)]
    points = [IndexPoint(i, vector, SparseVector([11], [1.0]), payload) for i in ids]
    before = index.info().points
    query = IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "tA"),)), limit=5, dense=vector)

    index.apply(points, [], 41)  # the common case: one write for the points and the position
    assert index.applied_position() == 41
    assert sorted(h.id for h in index.search(query)) == ids
    assert index.info().points == before + 2  # the position's own record is not counted as a memory

    index.apply(points[1:], [ids[0]], 42)
    assert index.applied_position() == 42 and [h.id for h in index.search(query)] == [ids[1]]


def _open_index(backend: str, path, embedder):
    from qdrant_client import QdrantClient

    from memory_server.storage.vectors.edge import EdgeIndex

    if backend == "edge":
        return EdgeIndex(path, embedder.dimension, embedder.name)
    return QdrantServerIndex(QdrantClient(":memory:"), "memories", embedder.dimension, embedder.name)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_indexes_of_the_same_memories_rank_equal_bm25_scores_alike(backend, tmp_path, embedder):
    """Texts of one length that share words tie on BM25 score, and Qdrant ranks equal scores in no
    fixed order, so two indexes of the same memories (two replicas, an index before and after a
    rebuild) fused them into different hybrid answers (bench/analysis.md, round 24). A memory's BM25
    weights carry a factor fixed by its id (sparse.tie_break): ties rank alike in every index."""
    import uuid

    from memory_server.storage.vectors.sparse import SparseEncoder, tie_break

    sparse = SparseEncoder()
    texts = [f"{name} likes {pastime}" for name in ("Ann", "Bob", "Cid", "Dee", "Eli", "Fay")
             for pastime in ("tea", "chess", "jazz", "golf", "opera")]
    ids, factors = [], set()
    for n in range(1, 1000):  # ids whose factors differ (4,096 of them: a large tie may hold two alike)
        candidate = str(uuid.UUID(int=n))
        if tie_break(candidate) not in factors:
            ids.append(candidate)
            factors.add(tie_break(candidate))
        if len(ids) == len(texts):
            break
    vectors = embedder.embed(texts)
    points = [IndexPoint(i, v.tolist(), sparse.document(t, i), {"tenant": "t", "user_id": "u", "agent_id": "",
                                                                "run_id": "", "metadata": {}})
              for i, t, v in zip(ids, texts, vectors)]
    first, second = _open_index(backend, tmp_path / "a", embedder), _open_index(backend, tmp_path / "b", embedder)
    try:
        first.upsert(points)
        for start in range(len(points), 0, -7):  # the other order, in small runs
            second.upsert(points[max(0, start - 7):start][::-1])
        scope = All((Field("tenant", "eq", "t"), Field("user_id", "eq", "u")))
        for query in ["who likes tea", "likes", "does Dee like it", "Bob and chess"]:
            for mode in ("keyword", "hybrid"):
                request = IndexQuery(mode=mode, filter=scope, limit=20 if mode == "keyword" else len(points),
                                     sparse=sparse.query(query), rrf_k=2, weights=(0.5, 1.0),
                                     dense=embedder.embed_query(query).tolist(), candidates=30)
                # Equal fused scores (two ranks can sum alike) are ordered by id, as the service does;
                # a hybrid search takes every point, so no such tie straddles its limit.
                answer = sorted((-h.score, h.id) for h in first.search(request))
                assert answer and answer == sorted((-h.score, h.id) for h in second.search(request)), (mode, query)
    finally:
        first.close()
        second.close()


def test_contract_refused_names_the_points_a_write_would_fail_on_without_writing(backend_runtime):
    index = backend_runtime.index
    vector = [1.0] + [0.0] * (index.dimension - 1)

    def point(n, metadata):
        return IndexPoint(f"7d9f1c8e-0000-4000-8000-00000000000{n}", vector, SparseVector([11], [1.0]),
                          {"tenant": "tA", "user_id": "u", "agent_id": "", "run_id": "", "metadata": metadata})

    good, surrogate = point(1, {"k": "v"}), point(2, {"k": "\ud800"})
    assert index.refused([good, surrogate]) == [surrogate.id]
    assert index.refused([]) == []
    assert index.info().points == 0  # nothing written


def test_contract_prepare_builds_the_write_ahead_and_leaves_a_point_it_cannot_convert(backend_runtime):
    index = backend_runtime.index
    vector = [1.0] + [0.0] * (index.dimension - 1)
    payload = {"tenant": "tA", "user_id": "u", "agent_id": "", "run_id": "", "metadata": {"k": "v"}, "expires_at": 4e9}
    good = IndexPoint("7d9f1c8e-0000-4000-8000-000000000001", vector, SparseVector([11], [1.0]), payload)
    prepared = index.prepare(good)
    assert prepared.native is not None and prepared == good  # the same point, its write built
    bad = replace(good, id="7d9f1c8e-0000-4000-8000-000000000002", payload={**payload, "metadata": {"k": "\ud800"}})
    assert index.refused([index.prepare(bad)]) == [bad.id]  # found as before, prepared or not
    index.apply([prepared], [], 7)
    query = IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "tA"), Field("metadata.k", "eq", "v"))),
                       limit=5, dense=vector)
    assert [h.id for h in index.search(query)] == [good.id] and index.applied_position() == 7


def test_a_large_add_written_with_points_prepared_beside_its_commit_is_indexed_as_stored(backend_runtime, admin):
    """A write of PREPARE_BESIDE_MIN new memories or more has its points converted on another
    thread during the commit, after its rows were stamped under the write lock: the index holds
    the stamped times, which a created_at filter finds."""
    from memory_server.services.vector_memory import PREPARE_BESIDE_MIN

    memories = backend_runtime.memories
    memories.add(admin, AddRequest(text="Ada waters the ferns on Sundays", user_id="ada"))
    assert memories._preparer is None  # a few points: converted where they are written
    items = [AddRequest(text=f"Ada's reading list, book {n}: volume {n * 7}", user_id="ada", metadata={"n": n})
             for n in range(PREPARE_BESIDE_MIN + 6)]
    added = memories.add_batch(admin, items).results
    assert memories._preparer is not None and {r.event for r in added} == {"ADD"}
    stamped = memories.get(admin, added[0].id).created_at
    for mode in ("dense", "keyword", "hybrid"):
        found = memories.search(admin, SearchRequest(
            query="book 12 of the reading list", mode=mode, top_k=100,
            filters={"user_id": "ada", "created_at": {"gte": stamped.isoformat()}, "metadata.n": {"gte": 0}}))
        assert {h.id for h in found} == {r.id for r in added}
        assert all(h.created_at == stamped for h in found)


def test_a_memory_the_index_cannot_hold_is_left_out_and_every_later_change_still_applies(tmp_path, embedder, admin,
                                                                                           caplog):
    """A stored memory whose point no index takes (data no request may write any more: an older
    version or a bug could have stored it) once stopped every later change from reaching the index.
    Now it alone is left out, logged and counted, and it is indexed again once changed. (On Qdrant
    Edge: qdrant-client's in-process stand-in keeps payloads as Python objects and takes it, where a
    real server would be sent JSON; the contract test above covers that backend's `refused`. On
    SQLite: PostgreSQL's jsonb refuses to store a lone surrogate at all.)"""
    settings = make_settings(tmp_path / "data")
    search = SearchRequest(query="who keeps bees or hens?", filters={"user_id": "quinn"}, mode="dense")
    with closing(Runtime.open(settings, embedder=embedder)) as rt:
        [bees] = rt.memories.add(admin, AddRequest(text="Quinn keeps bees on the roof", user_id="quinn")).results
        with rt.engine.begin() as connection:  # its metadata as SQLite holds it: a lone surrogate
            connection.exec_driver_sql(f"UPDATE {MemoryRecord.__tablename__} SET metadata = ? WHERE id = ?",
                                       ('{"note": "\\ud800"}', bees.id))
            connection.execute(ChangeLogEntry.__table__.insert(), [{
                "tenant_id": admin.tenant_id, "memory_id": bees.id, "op": "upsert",
                "created_at": datetime.now(timezone.utc)}])
        with caplog.at_level("ERROR", logger="memory_server"):
            [hens] = rt.memories.add(admin, AddRequest(text="Quinn keeps hens in the garden", user_id="quinn")).results
        assert bees.id in caplog.text and "left out" in caplog.text
        assert rt.sync.left_out == {bees.id}
        assert [h.id for h in rt.memories.search(admin, search)] == [hens.id]  # its old point went too
        assert rt.sync.rebuild() == 2  # a rebuild from SQL leaves it out the same way
        assert [h.id for h in rt.memories.search(admin, search)] == [hens.id]
        assert rt.sync.left_out == {bees.id}
    # The set is kept with the index's position: a restart still knows it, and says so.
    caplog.clear()
    with caplog.at_level("ERROR", logger="memory_server"):
        rt = Runtime.open(settings, embedder=embedder)
    with closing(rt):
        assert rt.sync.left_out == {bees.id}
        assert "1 memories are left out of the vector index" in caplog.text and bees.id in caplog.text
        assert [h.id for h in rt.memories.search(admin, search)] == [hens.id]
        rt.memories.update(admin, bees.id, UpdateRequest(metadata={"note": "fixed"}))
        assert rt.sync.left_out == set()
        assert {h.id for h in rt.memories.search(admin, search)} == {bees.id, hens.id}
    with closing(Runtime.open(settings, embedder=embedder)) as rt:  # the change that brought it back is kept too
        assert rt.sync.left_out == set()
        assert {h.id for h in rt.memories.search(admin, search)} == {bees.id, hens.id}


def test_qdrant_server_keeps_the_left_out_set_with_its_position():
    """The Edge side is the restart above; a Qdrant server collection is reopened here by a second
    index object on the same client (a replica starting, or this one restarted)."""
    from qdrant_client import QdrantClient

    from memory_server.storage.vectors.qdrant import QdrantServerIndex

    index = QdrantServerIndex(QdrantClient(":memory:"), "memories", 4, "test-model")
    index.left_out = frozenset({"7d9f1c8e-0000-4000-8000-000000000001", "7d9f1c8e-0000-4000-8000-000000000002"})
    index.set_applied_position(7)
    other = QdrantServerIndex(index.client, index.collection, index.dimension, index.model)
    assert (other.applied_position(), other.left_out) == (7, index.left_out)
    index.left_out = frozenset()
    index.set_applied_position(8)
    other = QdrantServerIndex(index.client, index.collection, index.dimension, index.model)
    assert (other.applied_position(), other.left_out) == (8, frozenset())
    other.reset()  # a rebuild starts with nothing left out
    assert (other.applied_position(), other.left_out) == (0, frozenset())


def test_replicas_opening_a_new_qdrant_collection_at_once_all_start(embedder):
    """Replicas started together on a Qdrant server with no collection yet: one creates it, the
    others open it as it made it (they raced to create it, and the losers failed to start or met
    a collection without its meta point)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from qdrant_client import QdrantClient

    together, asked = threading.Barrier(4), threading.local()

    class Server(QdrantClient):
        """The in-process stand-in, with the one interleaving that matters made certain: every
        replica asks whether the collection exists before any of them creates it."""

        def collection_exists(self, name):
            exists = super().collection_exists(name)
            if not getattr(asked, "before", False):
                asked.before = True
                together.wait()
            return exists

    client = Server(":memory:")  # one server that every replica talks to

    def start(_):
        return QdrantServerIndex(client, "memories", embedder.dimension, embedder.name)

    with ThreadPoolExecutor(4) as pool:
        indexes = list(pool.map(start, range(4)))
    assert [index.applied_position() for index in indexes] == [0, 0, 0, 0]
    assert not any(index.outdated for index in indexes)
    point = IndexPoint("7d9f1c8e-0000-4000-8000-000000000009", [1.0] + [0.0] * (embedder.dimension - 1),
                       SparseVector([11], [1.0]), {"tenant": "tA", "user_id": "u", "agent_id": "", "run_id": "",
                                                   "metadata": {}})
    indexes[0].apply([point], [], 1)
    query = IndexQuery(mode="dense", filter=All((Field("tenant", "eq", "tA"),)), limit=5, dense=point.dense)
    assert [[hit.id for hit in index.search(query)] for index in indexes] == [[point.id]] * 4



@pytest.mark.parametrize("change", ["update", "delete"])
def test_an_adds_own_point_never_undoes_a_later_change(backend_runtime, admin, monkeypatch, change):
    """A race a review found (session 28): an add hands its catch-up the points it built, and used
    one whenever the run of entries named the memory once, even when another thread's catch-up (a
    search's) had applied the add's entry already and the run held a later update or delete: the
    deleted memory was back in the index, the updated one found by its old words. Here the add and
    the change are each held after their commit, before they apply, while a search's catch-up runs."""
    import threading

    memories = backend_runtime.memories
    real_publish = memories._publish
    committed = {name: threading.Event() for name in ("add", "change")}
    release = {name: threading.Event() for name in ("add", "change")}

    def publish(prepared=None, own=None):
        name = threading.current_thread().name
        if name in committed:
            committed[name].set()
            release[name].wait(30)
        real_publish(prepared, own)

    monkeypatch.setattr(memories, "_publish", publish)
    added = []
    add = threading.Thread(name="add", target=lambda: added.append(
        memories.add(admin, AddRequest(text="Rosa rides an old red bicycle", user_id="u1")).results[0].id))
    add.start()
    assert committed["add"].wait(30)
    backend_runtime.sync.follow()  # what a search does first: the add's entry is applied from its row
    memory_id = _only_memory_id(backend_runtime)
    if change == "update":
        work = lambda: memories.update(admin, memory_id, UpdateRequest(text="Rosa sold her bicycle and walks"))  # noqa: E731
    else:
        work = lambda: memories.delete(admin, memory_id)  # noqa: E731
    changer = threading.Thread(name="change", target=work)
    changer.start()
    assert committed["change"].wait(30)
    release["add"].set()  # the add applies what is after the index's position: the change
    add.join(30)
    release["change"].set()
    changer.join(30)
    assert added == [memory_id]
    old = memories.search(admin, SearchRequest(query="red", filters={"user_id": "u1"}, mode="keyword"))
    assert old == []
    assert backend_runtime.index.info().points == (1 if change == "update" else 0)
    if change == "update":
        new = memories.search(admin, SearchRequest(query="walks", filters={"user_id": "u1"}, mode="keyword"))
        assert [h.id for h in new] == [memory_id]


def _only_memory_id(runtime) -> str:
    from sqlmodel import Session, select

    with Session(runtime.engine) as session:
        (memory_id,) = session.exec(select(MemoryRecord.id)).all()
    return memory_id
