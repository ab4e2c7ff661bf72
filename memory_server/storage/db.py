"""The SQL engine: SQLite in the data directory by default, any SQLAlchemy URL otherwise."""

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, create_engine

from memory_server import models  # noqa: F401  (registers the tables)

# Serialises change-log appends on PostgreSQL so positions become visible in order.
CHANGE_LOG_LOCK_ID = 0x6D656D6F


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # A pool as large as the request thread pool: an overflow connection is opened and closed
        # per request otherwise, PRAGMAs and all.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=40, max_overflow=20)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def create_schema(engine: Engine) -> None:
    SQLModel.metadata.create_all(engine)


def lock_change_log(session: Session) -> None:
    """Hold the append lock until commit, so a reader never sees position N+1 before N."""
    if session.get_bind().dialect.name == "postgresql":
        session.exec(text("SELECT pg_advisory_xact_lock(:k)").bindparams(k=CHANGE_LOG_LOCK_ID))


def ping(engine: Engine) -> bool:
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
