"""Settings, read once from the environment (prefix MEMORY_SERVER_) and validated."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every setting is documented in docs/configuration.md (a test keeps that true)."""

    model_config = SettingsConfigDict(env_prefix="MEMORY_SERVER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64)
    data_dir: Path = Path("./memory-data")
    database_url: str | None = None
    qdrant_url: str | None = None
    qdrant_api_key: str | None = None
    qdrant_collection: str = "memories"

    embedding_model: str = "all-MiniLM-L6-v2"
    embedding_backend: Literal["onnx", "torch"] = "onnx"
    embedding_device: str = "cpu"
    # None: int8 on onnx, full precision on torch; int8-asymmetric: the int8 model before round 15 (see embedding.py)
    embedding_quantize: Literal["none", "int8", "int8-asymmetric"] | None = None
    embedding_threads: int = Field(0, ge=0, le=256)  # parallel model calls; 0 = one per CPU
    model_dir: Path | None = None  # where the ONNX export is kept; default <data_dir>/models
    embedding_batch_size: int = Field(16, ge=1, le=4096)
    embedding_gather_size: int = Field(10, ge=1, le=4096)  # texts a model call takes from concurrent requests
    query_cache_size: int = Field(1024, ge=0)
    row_cache_mb: float = Field(32.0, ge=0)  # search hits' rows kept in memory, per process (index_sync.RowCache)
    embedding_wait_ms: float = Field(8.0, ge=0, le=1000)  # how long a model call may wait for texts already on their way

    message_context_turns: int = Field(2, ge=0, le=20)
    key_cache_seconds: float = Field(5.0, ge=0)
    dedup_threshold: float = Field(0.95, ge=0.0, le=1.0)
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    max_memory_bytes: int = Field(32 * 1024, ge=16)
    max_batch_items: int = Field(1000, ge=1)

    rrf_k: int = Field(2, ge=1)
    hybrid_dense_weight: float = Field(0.5, ge=0.0)
    hybrid_keyword_weight: float = Field(1.0, ge=0.0)
    search_candidates: int = Field(100, ge=10, le=10000)

    expiry_sweep_seconds: float = Field(60.0, gt=0)
    sync_interval_seconds: float = Field(1.0, gt=0)
    index_optimize_every: int = Field(20000, ge=100)
    index_optimize_idle_seconds: float = Field(2.0, ge=0)  # ... once no request used the index for this long
    index_optimize_deferred_max: int = Field(100000, ge=100)  # ... or at once past this many changes
    index_search_threads: int = Field(1, ge=0, le=256)  # Qdrant Edge search pool; 0 = one per CPU
    sqlite_background_checkpoints: bool = True  # a large commit's WAL checkpoint on a thread beside it (storage/db.py)
    warm_database: bool = True  # read the SQLite file into the page cache at start when it fits
    request_threads: int = Field(4, ge=1, le=1024)  # requests a worker runs at once; more wait their turn
    direct_routes: bool = True  # add, batch add and search answered ahead of FastAPI (api/direct.py)
    server_timing: bool = True  # a Server-Timing header on each response: where its time went (timing.py)
    log_level: Literal["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"] = "INFO"
    access_log: bool = True  # a line per request on standard output (access_log.py)
    batch_scheduling: bool = True  # serve's threads under Linux's SCHED_BATCH (cli.batch_scheduling)
    request_head_timeout_seconds: float = Field(30.0, gt=0, le=3600)  # a request's line and headers (protocol.py)

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        value = value.expanduser()
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} is not a directory")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value):
        return value.upper() if isinstance(value, str) else value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        """Refused here rather than when the engine is made; the URL is left out of the message
        (it may hold a password)."""
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        if value:
            try:
                make_url(value).get_dialect()
            except ArgumentError:
                raise ValueError("not a database URL (e.g. postgresql+psycopg://user:pass@host:5432/db)") from None
            except NoSuchModuleError:
                raise ValueError("no such kind of database (use sqlite:/// or postgresql+psycopg://)") from None
        return value

    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir or self.data_dir / "models"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'memory.db').resolve()}"
