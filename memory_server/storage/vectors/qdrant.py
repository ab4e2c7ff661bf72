"""A Qdrant server (or cluster) through qdrant-client, behind the same VectorIndex interface."""

import time
from dataclasses import replace

from pydantic_core import PydanticSerializationError
from qdrant_client import QdrantClient, models

from memory_server.storage.vectors import Hit, IndexInfo, IndexPoint, IndexQuery
from memory_server.storage.vectors.edge import FLOAT_FIELDS, KEYWORD_FIELDS, META_ID, PAYLOAD_LAYOUT, check_model, meta_payload
from memory_server.storage.vectors.filters import Condition, Field, flatten

CREATION_WAIT_SECONDS = 10.0  # how long a replica waits for a collection another one is creating


class QdrantServerIndex:
    def __init__(self, client: QdrantClient, collection: str, dimension: int, model: str, *, recreate: bool = False):
        self.client = client
        self.collection = collection
        self.dimension = dimension
        self.model = model
        self._position = 0
        if recreate and client.collection_exists(collection):
            client.delete_collection(collection)
        self._open()

    def _open(self) -> None:
        if not self.client.collection_exists(self.collection):
            try:
                self.client.create_collection(
                    self.collection,
                    vectors_config={"dense": models.VectorParams(size=self.dimension, distance=models.Distance.COSINE)},
                    sparse_vectors_config={"bm25": models.SparseVectorParams(modifier=models.Modifier.IDF)},
                )
            except Exception:
                if not self.client.collection_exists(self.collection):
                    raise
                # Another replica created it at the same moment: open it as that one makes it.
            else:
                self._prepare_new()
                return
        payload = self._meta_payload()
        check_model(payload, self.dimension, self.model, f"Qdrant collection '{self.collection}'")
        self._position = int(payload.get("position", 0))
        self.left_out = frozenset(payload.get("left_out", ()))
        self.outdated = int(payload.get("layout", 1)) < PAYLOAD_LAYOUT

    def _prepare_new(self) -> None:
        """The payload indexes of a collection just created, then its meta point."""
        self.outdated = False
        self.left_out = frozenset()
        self.client.create_payload_index(
            self.collection, "tenant", models.KeywordIndexParams(type=models.KeywordIndexType.KEYWORD, is_tenant=True)
        )
        for name in KEYWORD_FIELDS:
            self.client.create_payload_index(self.collection, name, models.PayloadSchemaType.KEYWORD)
        for name in FLOAT_FIELDS:
            self.client.create_payload_index(self.collection, name, models.PayloadSchemaType.FLOAT)
        self.set_applied_position(0)

    def _meta_payload(self) -> dict:
        """The collection's meta point; one that another replica is still creating gets it within
        moments (its payload indexes come first)."""
        deadline = time.monotonic() + CREATION_WAIT_SECONDS
        while True:
            meta = self.client.retrieve(self.collection, [META_ID], with_payload=True)
            if meta or time.monotonic() > deadline:
                return meta[0].payload if meta else {}
            time.sleep(0.1)

    def close(self) -> None:
        self.client.close()

    def reset(self) -> None:
        self.client.delete_collection(self.collection)
        self._open()

    def prepare(self, point: IndexPoint) -> IndexPoint:
        try:
            return replace(point, native=_point(point))
        except (ValueError, TypeError):  # the client's model refuses it: see refused
            return point

    def upsert(self, points: list[IndexPoint]) -> None:
        if points:
            self.client.upsert(self.collection, [_point(p) for p in points], wait=True)

    def delete(self, ids: list[str]) -> None:
        if ids:
            self.client.batch_update_points(self.collection, _deletes(ids), wait=True)

    def refused(self, points: list[IndexPoint]) -> list[str]:
        refused = []
        for p in points:
            try:  # the client's model, then the JSON a Qdrant server is sent, as the client makes it
                _point(p).model_dump_json()
            except (ValueError, TypeError, PydanticSerializationError):
                refused.append(p.id)
        return refused

    def applied_position(self) -> int:
        return self._position

    def set_applied_position(self, position: int) -> None:
        self.apply([], [], position)

    def apply(self, points: list[IndexPoint], deleted: list[str], position: int) -> None:
        # One request, its operations applied in order: the position never lands without the
        # points and deletes it covers.
        operations = [models.UpsertOperation(upsert=models.PointsList(points=[_point(p) for p in points]))] if points else []
        if deleted:
            operations.extend(_deletes(deleted))
        operations.append(models.UpsertOperation(upsert=models.PointsList(points=[self._meta_point(position)])))
        self.client.batch_update_points(self.collection, operations, wait=True)
        self._position = position

    def _meta_point(self, position: int) -> models.PointStruct:
        return models.PointStruct(id=META_ID, vector={}, payload=meta_payload(self, position))

    def optimize(self) -> None:
        """A Qdrant server runs its optimizers on its own."""

    def search(self, query: IndexQuery) -> list[Hit]:
        return self.search_batch([query])[0]

    def may_hold_expired(self, now: float) -> bool:
        # The collection is shared: other processes write to it, so this one cannot know what it holds.
        return True

    def search_batch(self, queries: list[IndexQuery]) -> list[list[Hit]]:
        requests = [_request(query) for query in queries]
        runnable = [request for request in requests if request is not None]
        answers = iter(self.client.query_batch_points(self.collection, runnable) if runnable else [])
        return [[] if request is None else [Hit(str(p.id), float(p.score)) for p in next(answers).points]
                for request in requests]

    def info(self) -> IndexInfo:
        count = self.client.count(self.collection, exact=True).count
        return IndexInfo("qdrant", self.dimension, max(0, count - 1), self._position, {"collection": self.collection})


def _request(query: IndexQuery) -> models.QueryRequest | None:
    """The Qdrant request for a query; None when it cannot match anything (a keyword query
    without searchable terms)."""
    flt = _filter(query.filter)
    sparse = None
    if query.sparse and query.sparse.indices:
        sparse = models.SparseVector(indices=query.sparse.indices, values=query.sparse.values)
    if query.mode == "dense":
        return models.QueryRequest(query=query.dense, using="dense", filter=flt, limit=query.limit,
                                   score_threshold=query.min_score)
    if query.mode == "keyword":
        if sparse is None:
            return None
        return models.QueryRequest(query=sparse, using="bm25", filter=flt, limit=query.limit)
    prefetch = [models.Prefetch(query=query.dense, using="dense", filter=flt, limit=query.candidates)]
    weights = [query.weights[0]]
    if sparse is not None:
        prefetch.append(models.Prefetch(query=sparse, using="bm25", filter=flt, limit=query.candidates))
        weights.append(query.weights[1])
    # No filter on the fusion: the prefetches are filtered already (as in edge.py).
    return models.QueryRequest(prefetch=prefetch, query=models.RrfQuery(rrf=models.Rrf(k=query.rrf_k, weights=weights)),
                               limit=query.limit)


def _filter(node: Condition) -> models.Filter:
    must, should, must_not = flatten(node)  # as in edge.py: a smaller request
    return models.Filter(must=[_translate(item) for item in must] or None,
                         should=None if should is None else [_translate(item) for item in should],
                         must_not=[_translate(item) for item in must_not] or None)


def _translate(node: Condition):
    return _field(node) if isinstance(node, Field) else _filter(node)


def _field(leaf: Field):
    key, op, value = leaf.key, leaf.op, leaf.value
    if op == "eq":
        if isinstance(value, float):
            return models.FieldCondition(key=key, range=models.Range(gte=value, lte=value))
        return models.FieldCondition(key=key, match=models.MatchValue(value=value))
    if op == "in":
        return models.FieldCondition(key=key, match=models.MatchAny(any=list(value)))
    if op == "substring":
        return models.FieldCondition(key=key, match=models.MatchSubstring(substring=value))
    return models.FieldCondition(key=key, range=models.Range(**{op: value}))


def _deletes(ids: list[str]) -> list:
    """Each point written again without its keyword vector, then deleted: the Qdrant engine keeps a
    deleted point's terms in a segment's BM25 document frequencies until the segment is rebuilt (see
    EdgeIndex.delete)."""
    blank = [models.PointStruct(id=i, vector={"bm25": models.SparseVector(indices=[], values=[])}, payload={})
             for i in ids]
    return [models.UpsertOperation(upsert=models.PointsList(points=blank)),
            models.DeleteOperation(delete=models.PointIdsList(points=list(ids)))]


def _point(p: IndexPoint) -> models.PointStruct:
    if p.native is not None:  # prepared ahead (QdrantServerIndex.prepare)
        return p.native
    return models.PointStruct(
        id=p.id,
        vector={"dense": p.dense, "bm25": models.SparseVector(indices=p.sparse.indices, values=p.sparse.values)},
        payload=p.payload,
    )
