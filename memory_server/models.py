"""SQL tables: the source of truth for memories, their history, the change log and API keys."""

import os
import time
import uuid
from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, Integer, LargeBinary, String, Text
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel


def embedding_input(text: str, context: str | None) -> str:
    """What the model embeds for a memory: its text, after the conversation that led to it."""
    return f"{context}\n{text}" if context else text


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_memory_ids(count: int) -> list[str]:
    """`count` UUIDv7s (RFC 9562), in ascending order: 48 bits of Unix time in milliseconds, then
    74 random bits. Ids made later sort later, so a batch's new memories land at the end of the
    indexes keyed by id (the primary key, history's memory_id) instead of each on a random page of
    them: a batch of 1,000 commits in 68 instead of 86 ms at 100k memories, 84 instead of 113 ms at
    300k (the add rate itself moved less than the noise; bench/analysis.md, round 14). The id tells
    when the memory was made, which `created_at` says anyway. The random bits of the whole batch
    come from one `os.urandom` call: a call per id released and re-took the GIL each time, ~7 us an
    id with a batch add's model threads running against ~2 us (bench/analysis.md, round 16)."""
    millis = time.time_ns() // 1_000_000
    noise = os.urandom(10 * count)
    ids = []
    for i in range(0, 10 * count, 10):
        rand_a = int.from_bytes(noise[i:i + 2], "big") & 0xFFF
        rand_b = int.from_bytes(noise[i + 2:i + 10], "big") >> 2
        # unix_ts_ms (48 bits) | version 7 (4) | rand_a (12) | variant 0b10 (2) | rand_b (62)
        ids.append((millis << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b)
    return [str(uuid.UUID(int=i)) for i in sorted(ids)]


class UTCDateTime(TypeDecorator):
    """Stores UTC, always hands back timezone-aware datetimes (SQLite forgets the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def _time_column(nullable: bool = False, index: bool = False) -> Column:
    return Column(UTCDateTime(), nullable=nullable, index=index)


# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
_BigIntId = BigInteger().with_variant(Integer, "sqlite")


class MemoryRecord(SQLModel, table=True):
    __tablename__ = "memories"
    __table_args__ = (
        Index("ix_memories_scope", "tenant_id", "user_id", "agent_id", "run_id"),
        Index("ix_memories_listing", "tenant_id", "created_at", "id"),
        Index("ix_memories_user_listing", "tenant_id", "user_id", "created_at", "id"),
        # The scope is in the index so that the exact-duplicate check of an add reads the index alone.
        Index("ix_memories_hash_scope", "tenant_id", "hash", "user_id", "agent_id", "run_id"),
    )

    id: str = Field(primary_key=True, max_length=36)
    tenant_id: str = Field(max_length=128)
    user_id: str | None = Field(default=None, max_length=128)
    agent_id: str | None = Field(default=None, max_length=128)
    run_id: str | None = Field(default=None, max_length=128)
    text: str = Field(sa_column=Column(Text, nullable=False))
    # Preceding messages of the same conversation, embedded with the text (never returned as the memory).
    context: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    hash: str = Field(max_length=32)
    meta: dict = Field(default_factory=dict, sa_column=Column("metadata", JSON, nullable=False))
    embedding: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = Field(sa_column=_time_column())
    updated_at: datetime = Field(sa_column=_time_column())
    expires_at: datetime | None = Field(default=None, sa_column=_time_column(nullable=True, index=True))


class MemoryHistory(SQLModel, table=True):
    __tablename__ = "memory_history"

    id: int | None = Field(default=None, sa_column=Column(_BigIntId, primary_key=True, autoincrement=True))
    memory_id: str = Field(max_length=36, index=True)
    tenant_id: str = Field(max_length=128)
    user_id: str | None = Field(default=None, max_length=128)
    agent_id: str | None = Field(default=None, max_length=128)
    event: str = Field(max_length=16)
    old_memory: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    new_memory: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    actor: str = Field(max_length=128)
    created_at: datetime = Field(sa_column=_time_column())


class ChangeLogEntry(SQLModel, table=True):
    """Append-only: every index-visible change to a memory, at a monotonic position."""

    __tablename__ = "change_log"

    position: int | None = Field(default=None, sa_column=Column(_BigIntId, primary_key=True, autoincrement=True))
    tenant_id: str = Field(max_length=128)
    memory_id: str = Field(max_length=36)
    # "add" (a new memory's first entry: services/index_sync.py _changes) | "upsert" | "delete"
    op: str = Field(max_length=8)
    created_at: datetime = Field(sa_column=_time_column())


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_keys"

    id: str = Field(primary_key=True, max_length=32)
    tenant_id: str = Field(max_length=128, index=True)
    role: str = Field(max_length=16)
    key_hash: str = Field(sa_column=Column(String(64), unique=True, nullable=False))
    user_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    agent_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    label: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(sa_column=_time_column())
    revoked_at: datetime | None = Field(default=None, sa_column=_time_column(nullable=True))
