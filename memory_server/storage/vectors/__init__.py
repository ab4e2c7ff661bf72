"""The one adapter interface of our own: a vector index (Qdrant Edge in-process or a Qdrant server)."""

from dataclasses import dataclass, field
from typing import Literal, Protocol

from memory_server.storage.vectors.filters import Condition

SearchMode = Literal["dense", "keyword", "hybrid"]


@dataclass(frozen=True)
class SparseVector:
    indices: list[int]
    values: list[float]


@dataclass(frozen=True)
class IndexPoint:
    id: str
    dense: list[float]
    sparse: SparseVector
    payload: dict
    # The backend's own form of the point, when built ahead of the write (VectorIndex.prepare).
    native: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class IndexQuery:
    mode: SearchMode
    filter: Condition
    limit: int
    dense: list[float] | None = None
    sparse: SparseVector | None = None
    candidates: int = 100
    rrf_k: int = 60
    weights: tuple[float, float] = (1.0, 1.0)  # (dense, keyword) in hybrid fusion
    min_score: float | None = None  # dense: only hits with a cosine at least this (the dedup check's)


@dataclass(frozen=True)
class Hit:
    id: str
    score: float  # raw backend score: cosine, BM25 or RRF


@dataclass
class IndexInfo:
    backend: str
    dimension: int
    points: int
    applied_position: int
    extra: dict = field(default_factory=dict)


class VectorIndex(Protocol):
    """Derived from SQL; every method is idempotent so change-log replay is always safe."""

    dimension: int
    outdated: bool  # made by an older version with another payload layout: rebuild before use
    # Memories this index could not hold (IndexSync._apply), kept with the position: the next
    # write of the position records the set as it is then, and opening the index reads it back.
    left_out: frozenset[str]

    def prepare(self, point: IndexPoint) -> IndexPoint:
        """The point with its backend form built now (`native`), so that the write that applies
        it later converts nothing: a batch add prepares its points while the model still embeds
        its later texts, off the write that follows its commit. A point the backend cannot
        convert comes back as it was (the write then finds it: see refused)."""

    def upsert(self, points: list[IndexPoint]) -> None: ...

    def delete(self, ids: list[str]) -> None: ...

    def search(self, query: IndexQuery) -> list[Hit]: ...

    def search_batch(self, queries: list[IndexQuery]) -> list[list[Hit]]:
        """One hit list per query, in order; planned and run together (a batch add's duplicate checks)."""

    def may_hold_expired(self, now: float) -> bool:
        """False only when the index is sure that none of its points expires at or before `now`
        (payload `expires_at`, epoch seconds): a search may then leave the expiry condition out."""

    def applied_position(self) -> int: ...

    def set_applied_position(self, position: int) -> None: ...

    def apply(self, points: list[IndexPoint], deleted: list[str], position: int) -> None:
        """Upsert `points`, delete `deleted`, then record `position`, as one write where the backend
        can (the change log's follower calls this for each run of entries)."""

    def refused(self, points: list[IndexPoint]) -> list[str]:
        """The ids of the points this index cannot hold, found by converting each one as a write
        would, without writing anything (the change log's follower asks after a failed write)."""

    def reset(self) -> None:
        """Drop every point (reindex starts from here); position goes back to 0."""

    def optimize(self) -> None: ...

    def info(self) -> IndexInfo: ...

    def close(self) -> None: ...
