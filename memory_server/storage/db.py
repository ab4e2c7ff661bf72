"""The SQL engine: SQLite in the data directory by default, any SQLAlchemy URL otherwise."""

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone

from sqlalchemy import Table, event, inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.schema import CreateIndex
from sqlmodel import Session, SQLModel, create_engine

from memory_server import models  # noqa: F401  (registers the tables)
from memory_server.storage.files import read_whole_elsewhere
from memory_server.storage.shared_word import SharedWord
from memory_server.timing import name_os_thread

log = logging.getLogger("memory_server")

# Serialises change-log appends on PostgreSQL so positions become visible in order.
CHANGE_LOG_LOCK_ID = 0x6D656D6F
# How long an SQLite statement waits for another connection's lock before "database is locked".
BUSY_TIMEOUT_MS = 30000


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # A pool as large as the request thread pool: an overflow connection is opened and closed
        # per request otherwise, PRAGMAs and all.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
                               pool_size=40, max_overflow=20)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            _use_wal(cursor)
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            cursor.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _use_wal(cursor, wait_seconds: float = 30.0) -> None:
    """Put an SQLite file in WAL mode (it stays so). Switching a new file is refused at once with
    "database is locked", without the busy timeout, while another process that is starting too
    holds a lock on it (replicas or workers started together: one failed, seen in CI, session 29),
    so the switch is tried again for up to `wait_seconds`. A file in WAL mode already needs no lock."""
    if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class WalCheckpointer:
    """Copies SQLite's write-ahead log into the database file on a thread of its own, instead of in
    the commits of the requests.

    SQLite checkpoints right after the commit that takes the WAL past 1,000 pages, in that commit's
    call, and its request waits for the copy: a batch of 1,000 adds (~4,250 pages) waited ~70 ms at
    100k memories while the model's threads idled (bench/analysis.md, round 32), and under a load of
    single adds, one after another, every ~80th add's commit took 5-8 ms instead of ~0.1 (round 41).
    Here the engine's connections have SQLite's automatic checkpoints off (set as each is first
    checked out of the pool), and this thread checkpoints:
    - right after a large commit (LARGE_COMMIT_ROWS rows changed or more), beside the work that
      follows it (the next batch's embedding);
    - every INTERVAL seconds while anything else was committed: a small commit only notes that it
      happened, as waking a thread after each of them cost more than the checkpoints do (a load of
      single adds, round 32).
    The checkpoint is PASSIVE: it never waits for or blocks readers and writers (another process's
    checkpoint meanwhile leaves it to that one) and copies what no reader still needs; the rest is
    copied by the next. One that fails is logged, and tried again at the next interval. `stop`
    hands the engine back with fresh connections, which have SQLite's own checkpoints."""

    LARGE_COMMIT_ROWS = 500  # rows changed since the connection left the pool: ~700 pages or more
    INTERVAL = 0.25  # seconds; a load of single adds writes ~1,000 pages in that time on a fast box

    def __init__(self, engine: Engine):
        self._engine = engine
        self._wanted = threading.Event()
        self._stopping = False
        self._committed = False  # since the last checkpoint
        self.checkpoints = 0
        self._listeners = (("checkout", self._checked_out), ("commit", self._committing),
                           ("checkin", self._checked_in))
        for name, listener in self._listeners:
            event.listen(engine, name, listener)
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    @staticmethod
    def _checked_out(dbapi_connection, record, _proxy) -> None:
        info = record.info
        if "checkpoints_beside" not in info:  # once a connection: it keeps the setting
            dbapi_connection.execute("PRAGMA wal_autocheckpoint=0")
            info["checkpoints_beside"] = True
        info["changes_before"] = dbapi_connection.total_changes

    @classmethod
    def _committing(cls, connection: Connection) -> None:
        """Before the driver's commit: note it on the connection, and whether it is a large one."""
        record = connection.connection
        dbapi_connection = record.dbapi_connection
        changed = dbapi_connection.total_changes - record.info.get("changes_before", dbapi_connection.total_changes)
        record.info["large_commit"] = record.info.get("large_commit", False) or changed >= cls.LARGE_COMMIT_ROWS

    def _checked_in(self, dbapi_connection, record) -> None:
        """The connection is back in the pool: its commit has landed (noted here, not before it:
        a checkpoint between the two would leave its pages to whatever commits next)."""
        if "large_commit" in record.info:
            self._committed = True
            if record.info.pop("large_commit"):
                self._wanted.set()

    def _run(self) -> None:
        name_os_thread()
        while True:
            self._wanted.wait(self.INTERVAL)
            self._wanted.clear()
            if self._stopping:
                return
            if self._committed:
                self._committed = False  # a commit from here on is copied by the next checkpoint
                self.checkpoint()

    def checkpoint(self) -> None:
        try:
            with self._engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            self.checkpoints += 1
        except Exception:  # the database is closing, the disk is full: the next interval tries again
            self._committed = True
            log.warning("checkpointing the SQLite WAL failed", exc_info=True)

    def stop(self) -> None:
        """End the thread after a last checkpoint, and replace the engine's connections (their
        automatic checkpoints are off)."""
        self._stopping = True
        self._wanted.set()
        self._thread.join(timeout=10)
        for name, listener in self._listeners:
            event.remove(self._engine, name, listener)
        if self._committed:
            self.checkpoint()
        self._engine.dispose()


def warm_sqlite_file(engine: Engine, available: int | None = None) -> int:
    """Read an SQLite database file once, start to end, so that its pages are in the page cache,
    when it fits in half the memory available; returns the bytes read (0: not SQLite, no file, or
    too large). A search reads its hits' rows by id, each on a page of its own: at 1M memories with
    the file out of the page cache (after a reboot) those reads took ~4-6 ms of a ~10-ms search
    (bench/analysis.md, round 11). `posix_fadvise(WILLNEED)` read only the first 8 MB here. A file
    that would crowd the page cache is left to warm with use. Read while searches already ran (a
    background thread), it doubled their latency for ~15 s: Runtime.open reads it before it answers,
    in a child process (read_whole_elsewhere says why)."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:" or not os.path.isfile(path):
        return 0
    size = os.path.getsize(path)
    if size == 0 or size > (available if available is not None else _available_memory()) // 2:
        return 0
    return read_whole_elsewhere(path)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HeadHint(SharedWord):
    """The change log's position as far as any process of this machine has applied it, in a small
    memory-mapped file beside the SQLite database (`<database>-head`), for the processes (workers)
    that serve it. A search must see every write answered before it began, whichever process took
    the write, and asked the database for the change log's head to know whether another process
    had written: ~0.1 ms of a request thread's CPU a search under part 3's load, ~15% of its part of
    a search (bench/analysis.md, round 36). Reading this file costs ~1 µs.

    Why it is enough: a process answers a write only once its own catch-up has applied it (read-
    your-writes), and IndexSync.catch_up publishes the position it reached before it lets go of its
    lock; so when a search begins, the hint is at or past every write answered before it, and a
    search whose index has applied that much can skip the database. The hint is never past what was
    committed (it only publishes what was applied), so it can make a search look for changes that it
    then finds applied already, never miss one. A write committed and not answered (its process
    died first) is seen by the next catch-up (the maintenance thread's, each second).

    Only for an SQLite file: every process that writes it runs on this machine. PostgreSQL serves
    replicas on other machines, which share no file; there every search asks the database."""

    @classmethod
    def beside(cls, engine: Engine) -> "HeadHint | None":
        """The hint of the engine's SQLite file; None for PostgreSQL, an in-memory database, or a
        platform without `fcntl` (then every search asks the database, as before)."""
        path = engine.url.database if engine.dialect.name == "sqlite" else None
        if not path or path == ":memory:":
            return None
        return cls.open(f"{path}-head", "every search asks the database for the change log's head")

    def publish(self, position: int) -> None:
        """Raise the hint to `position` (never lower it; two processes publishing at once cannot
        leave the smaller of their positions)."""
        self.raise_to(position)


# Indexes of earlier versions that a current one replaces: dropped when the schema is checked.
SUPERSEDED_INDEXES = ("ix_memories_hash",)


def create_schema(engine: Engine) -> None:
    """Create missing tables, and missing indexes of existing tables (so that an index added in a
    later version reaches databases made before it); drop superseded indexes. Safe to run from
    several processes at once: it all runs in one transaction that holds the write lock first
    (replicas starting together on a new PostgreSQL database otherwise raced to create the same
    tables, and all but one failed to start)."""
    with engine.begin() as connection:
        begin_write(connection)
        SQLModel.metadata.create_all(connection)
        inspector = inspect(connection)
        existing = {name for table in inspector.get_table_names()
                    for name in (i["name"] for i in inspector.get_indexes(table))}
        for table in SQLModel.metadata.sorted_tables:
            for index in table.indexes:
                if index.name not in existing:
                    log.info("creating index %s (once; a large table takes a while)", index.name)
                    connection.execute(CreateIndex(index, if_not_exists=True))
        for name in SUPERSEDED_INDEXES:
            if name in existing:
                connection.execute(text(f"DROP INDEX IF EXISTS {name}"))


def begin_write(connection: Connection) -> None:
    """Take the database's write lock now, before the statements that decide what to write: until
    this transaction ends no other writer (thread, worker or replica) commits, and what this one
    reads from here on includes everything committed before. SQLite: `BEGIN IMMEDIATE` (the driver
    would begin at the first write, after the reads). PostgreSQL: the change log's lock, which every
    write takes anyway (lock_change_log).

    It also begins SQLAlchemy's own transaction, which the statements run on the driver's cursor
    (driver_rows, RowEncoder) do not: without it the caller's `commit()` would end nothing and the
    pool would roll the writes back."""
    if not connection.in_transaction():
        connection.begin()
    if connection.dialect.name == "sqlite":
        dbapi_connection = connection.connection.dbapi_connection
        if not dbapi_connection.in_transaction:
            begin_immediate(dbapi_connection)
    else:
        lock_change_log(connection)


def begin_immediate(dbapi_connection: sqlite3.Connection, timeout: float | None = None) -> None:
    """`BEGIN IMMEDIATE`, tried again every 0.2-2 ms while another writer holds the lock, for up to
    `timeout` seconds (the busy timeout; then SQLite's "database is locked"). SQLite's own busy
    handler sleeps 1, 2, 5, 10, ... 100 ms between its tries, however briefly the lock is held: under
    load the slowest 1% of adds waited ~130 ms for a lock held ~1 ms at a time (bench/analysis.md,
    round 29). The busy handler is off only for these tries; every other statement keeps it."""
    deadline = time.monotonic() + (BUSY_TIMEOUT_MS / 1000 if timeout is None else timeout)
    pause = 0.0002
    dbapi_connection.execute("PRAGMA busy_timeout=0")
    try:
        while True:
            try:
                dbapi_connection.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                # (the low byte: SQLITE_BUSY whatever the extended code)
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
    finally:
        dbapi_connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def lock_change_log(session: Session | Connection) -> None:
    """Hold the append lock until commit, so a reader never sees position N+1 before N."""
    bind = session if isinstance(session, Connection) else session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)").bindparams(k=CHANGE_LOG_LOCK_ID))


def driver_rows(connection: Connection, sql: str, params: Sequence = ()) -> list[tuple]:
    """The rows of plain SQL run on the driver's own cursor, values as the driver gives them
    (`stored_time` and `stored_json` read them). For the statements every search runs: SQLAlchemy's
    execution path (its statement cache, binding, result processing) costs ~50 µs a statement, 4x
    what SQLite takes to answer these (bench/analysis.md, round 21). The cursor runs inside
    `connection`, whose end ends whatever it began."""
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql, params)
        return cursor.fetchall()
    finally:
        cursor.close()


class RowEncoder:
    """Rows of one table converted for the driver as they are made, so that inserting them later,
    under the write lock, is the driver's executemany alone. SQLAlchemy converts every value of an
    executemany as it runs it (times to text on SQLite, metadata to JSON, ...): half of a batch add's
    insert of 1,000 rows, ~30 of ~70 ms on a Zen 1, all of it under the write lock (bench/analysis.md,
    round 31). `late`: columns given their value at insert time, one value for all rows (an add's
    creation time, taken under the lock); it is converted once. Values are converted as the column's
    type converts them (its `bind_processor`), the same as SQLAlchemy's own insert. History and
    change-log rows go the same way (their one time converted once, not per row)."""

    def __init__(self, engine: Engine, table: Table, late: Sequence[str] = (), leave_out: Sequence[str] = ()):
        dialect = engine.dialect
        columns = [column for column in table.columns if column.name not in leave_out]  # e.g. an autoincrement key
        self.columns = [column.name for column in columns]
        self._convert = {column.name: column.type.dialect_impl(dialect).bind_processor(dialect) or _as_is
                         for column in columns}
        self._late = [(self.columns.index(name), name) for name in late]
        self._late_names = frozenset(late)
        quote = dialect.identifier_preparer.quote
        marker = "?" if dialect.paramstyle == "qmark" else "%s"
        self.sql = (f"INSERT INTO {quote(table.name)} ({', '.join(quote(name) for name in self.columns)}) "
                    f"VALUES ({', '.join([marker] * len(self.columns))})")

    def encode(self, row: dict) -> list:
        """`row`'s values as the driver takes them, in column order (the late ones still unset)."""
        return [None if name in self._late_names else self._convert[name](row[name]) for name in self.columns]

    def insert(self, connection: Connection, encoded: list[list], **late) -> None:
        """Insert rows made by `encode`, with the late columns' values, in `connection`'s transaction."""
        for position, name in self._late:
            value = self._convert[name](late[name])
            for values in encoded:
                values[position] = value
        if encoded:
            cursor = connection.connection.cursor()
            try:
                cursor.executemany(self.sql, encoded)
            finally:
                cursor.close()


def _as_is(value):
    return value


def placeholders(connection: Connection, count: int) -> str:
    """`count` parameter markers in the driver's style, comma-separated."""
    return ", ".join(["?" if connection.dialect.paramstyle == "qmark" else "%s"] * count)


def stored_time(value: datetime | str | None) -> datetime | None:
    """A time column as the driver returns it, as models.UTCDateTime reads it: UTC, zone attached
    (SQLite hands back text without a zone)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def stored_json(value):
    """A JSON column as the driver returns it: SQLite's text, PostgreSQL's driver decodes it itself."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def ping(engine: Engine) -> bool:
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
