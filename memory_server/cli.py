"""The memory-server command: serve, keys, reindex."""

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from sqlmodel import Session

from memory_server.config import Settings

app = typer.Typer(help="memory-server: long-term memory for LLM agents.", no_args_is_help=True)
keys_app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)

DataDir = Annotated[Optional[Path], typer.Option("--data-dir", help="Data directory (MEMORY_SERVER_DATA_DIR).")]


def _fail(message: str) -> NoReturn:
    """Refuse the command: one `error: …` line on stderr (never wrapped, unlike the console's), exit status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _settings(data_dir: Path | None = None, **options) -> Settings:
    """The environment's settings with the command's options over them. A bad value is refused naming
    its option or variable; a data directory that does not exist yet is created and named, so that a
    mistyped --data-dir shows as the new, empty store it makes."""
    values = {k: v for k, v in options.items() if v is not None}
    if data_dir is not None:
        values["data_dir"] = data_dir
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        _fail("; ".join(_setting_error(error, values) for error in exc.errors()))
    if not settings.data_dir.is_dir():
        try:
            settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # see open_database
        except OSError as exc:
            _fail(f"cannot create the data directory {settings.data_dir}: {exc.strerror or exc}")
        typer.echo(f"created a new, empty data directory {settings.data_dir.resolve()}", err=True)
    return settings


def _setting_error(error: dict, options: dict) -> str:
    """`--port: Input should be …` or `MEMORY_SERVER_PORT: …`, whichever the value came from (never
    the value itself: a database URL may hold a password)."""
    name = str(error["loc"][0]) if error["loc"] else "settings"
    where = "--" + name.replace("_", "-") if name in options else f"MEMORY_SERVER_{name.upper()}"
    return f"{where}: {error['msg'].removeprefix('Value error, ')}"


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="Bind address (MEMORY_SERVER_HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (MEMORY_SERVER_PORT).")] = None,
    data_dir: DataDir = None,
    workers: Annotated[Optional[int], typer.Option(help="Server processes (MEMORY_SERVER_WORKERS).")] = None,
) -> None:
    """Run the HTTP server (embedded SQLite + Qdrant Edge unless URLs are configured)."""
    import functools
    import os

    import uvicorn

    from memory_server.app import configure_logging, create_app
    from memory_server.protocol import BoundedHttpToolsProtocol

    settings = _settings(data_dir, host=host, port=port, workers=workers)
    configure_logging(settings)
    logging.getLogger("memory_server").info("data directory %s", settings.data_dir.resolve())
    if settings.batch_scheduling:
        batch_scheduling()
    # A longer keep-alive than uvicorn's 5 s: clients and proxies that reuse connections under load
    # otherwise race the server's close (seen as rare connection resets in the HTTP benchmark).
    # Heads bounded in size and time (protocol.py); a stop waits at most 30 s for requests in hand
    # (a client stalled mid-body held a one-process server's SIGTERM for good).
    # The app writes the access log (memory_server/access_log.py), not uvicorn.
    options = dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(), timeout_keep_alive=30,
                   access_log=False, timeout_graceful_shutdown=30,
                   http=functools.partial(BoundedHttpToolsProtocol, head_timeout=settings.request_head_timeout_seconds))
    if settings.workers == 1:
        from memory_server import workers as worker_processes
        from memory_server.errors import StartupError

        try:  # bound before anything loads: a port in use is refused at once, not after the model
            listener = worker_processes.listen(settings.host, settings.port)
        except StartupError as exc:
            _fail(str(exc))
        del options["host"], options["port"]
        uvicorn.Server(uvicorn.Config(create_app(settings), **options)).run(sockets=[listener])
        return
    # Each worker process builds its own app from the environment: pass the command-line options on,
    # and share the cores between the workers' model threads.
    os.environ.update(MEMORY_SERVER_DATA_DIR=str(settings.data_dir.resolve()), MEMORY_SERVER_HOST=settings.host,
                      MEMORY_SERVER_PORT=str(settings.port))
    if not settings.embedding_threads:
        os.environ["MEMORY_SERVER_EMBEDDING_THREADS"] = str(max(1, (os.cpu_count() or 1) // settings.workers))
    _bootstrap(settings)  # once, before the workers race for it (the key, the model files)
    from memory_server import workers as worker_processes

    if not worker_processes.hands_off_connections():
        uvicorn.run("memory_server.app:create_app", factory=True, workers=settings.workers, **options)
        return
    from memory_server.errors import StartupError

    del options["host"], options["port"]
    try:
        status = worker_processes.run(settings.workers, settings.host, settings.port, options)
    except StartupError as exc:
        _fail(str(exc))
    raise typer.Exit(status)


def batch_scheduling() -> None:
    """Run this process, and every thread and process it starts after this call, under Linux's
    SCHED_BATCH policy: the same share of the CPU, but a thread of the server that wakes (a request
    thread handed a search, the event loop with a response to write, a model thread with texts)
    no longer preempts the server's thread running on that core; it waits for the running one's
    time slice to end. Fewer switches between the model's calls and the requests' Python: at 64
    HTTP clients on a 2-core Zen 5, ~6% less CPU a request and ~7% more requests a second in
    alternating 20-s runs, no difference beyond the box's swings in 60-s ones (bench/analysis.md,
    round 39); on a 2-core Intel Xeon with AMX, ~8% less CPU a request in four of four alternating
    pairs (round 40). Other programs on the machine (a database, a proxy) still preempt the server
    when they wake. No privilege is needed to choose it; elsewhere than Linux it does nothing."""
    import os

    if not hasattr(os, "SCHED_BATCH"):
        return
    # Every thread already running (OpenBLAS starts its own as numpy is imported), this one among
    # them: every later thread and process inherits it from its creator.
    try:
        threads = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # this thread alone
    try:
        for thread in threads:
            try:
                os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:  # it ended meanwhile
                pass
    except OSError as exc:  # a container's seccomp profile may refuse it: run as before
        logging.getLogger("memory_server").warning("could not choose the SCHED_BATCH scheduling policy: %s", exc)


def _bootstrap(settings: Settings) -> None:
    from memory_server.runtime import ensure_bootstrap_key, open_database

    if settings.embedding_backend == "onnx":
        from memory_server.embedding import default_quantize, onnx_model_files, resolve_model_path

        onnx_model_files(resolve_model_path(settings.embedding_model), settings.resolved_model_dir,
                         settings.embedding_quantize or default_quantize("onnx"))
    engine = open_database(settings)
    try:
        key_file = ensure_bootstrap_key(engine, settings.data_dir)
        if key_file is not None:
            logging.getLogger("memory_server").warning(
                "created the bootstrap admin key; it is in %s (mode 0600)", key_file)
    finally:
        engine.dispose()


@app.command()
def reindex(
    data_dir: DataDir = None,
    reembed: Annotated[bool, typer.Option("--reembed", help="Embed every memory again with the configured model "
                                                            "(needed after changing MEMORY_SERVER_EMBEDDING_MODEL).")] = False,
) -> None:
    """Rebuild the vector index from SQL (stored embeddings unless --reembed)."""
    from memory_server.errors import StartupError
    from memory_server.runtime import Runtime

    settings = _settings(data_dir)
    try:
        runtime = Runtime.open(settings, recreate_index=True)
    except StartupError as exc:  # a running server holds the index, say
        _fail(str(exc))
    try:
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("reindexing", total=None)
            done = runtime.sync.rebuild(lambda n, total: progress.update(task, completed=n, total=total),
                                        reembed=runtime.embedder if reembed else None)
        runtime.sync.catch_up()
        console.print(f"reindexed {done} memories" + (" (re-embedded)" if reembed else ""))
        if getattr(runtime.index, "path", None) is not None:
            from memory_server.storage.vectors.edge import drop_unheld_shards

            for path in drop_unheld_shards(runtime.settings.data_dir, runtime.index.path):
                console.print(f"removed {path.name} (another server process's index; rebuilt from the log when needed)")
    except StartupError as exc:
        _fail(str(exc))
    finally:
        runtime.close()


@contextmanager
def _key_session(data_dir: Path | None):
    """A database session for the key commands; bad input exits 2 with its message."""
    from memory_server.errors import MemoryServerError
    from memory_server.runtime import open_database

    engine = open_database(_settings(data_dir))
    try:
        with Session(engine) as session:
            yield session
    except MemoryServerError as exc:
        _fail(exc.message)
    finally:
        engine.dispose()


def _check_label(label: str) -> None:
    """A label as the HTTP API takes it (KeyCreate: its length, one line)."""
    from memory_server.schemas import KeyCreate

    try:
        KeyCreate(role="agent", label=label)
    except ValidationError as exc:
        _fail(f"--label: {exc.errors()[0]['msg'].removeprefix('Value error, ')}")


def _shown(label: str) -> str:
    """A label on one `keys list` field: control characters written as escapes (\\t, \\n, …)."""
    from memory_server.schemas import is_line_break_or_control

    return "".join(c.encode("unicode_escape").decode() if is_line_break_or_control(c) else c for c in label)


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to.")],
    role: Annotated[str, typer.Option(help="admin or agent.")] = "agent",
    user_id: Annotated[Optional[list[str]], typer.Option("--user-id", help="Restrict to this user_id (repeatable).")] = None,
    agent_id: Annotated[Optional[list[str]], typer.Option("--agent-id", help="Restrict to this agent_id (repeatable).")] = None,
    label: Annotated[Optional[str], typer.Option(help="A note to recognise the key by.")] = None,
    data_dir: DataDir = None,
) -> None:
    """Create a key; the key itself is printed alone on the last line (shown once)."""
    from memory_server.auth import create_key

    if label is not None:
        _check_label(label)
    with _key_session(data_dir) as session:
        row, plaintext = create_key(session, tenant_id=tenant, role=role, user_ids=user_id or [],
                                    agent_ids=agent_id or [], label=label)
    print(f"created {row.id} (tenant {row.tenant_id}, role {row.role}); store the key now, it is not shown again:")
    print(plaintext)


@keys_app.command("list")
def keys_list(tenant: Annotated[Optional[str], typer.Option(help="Only this tenant.")] = None,
              data_dir: DataDir = None) -> None:
    """List keys (never their secrets)."""
    from memory_server.auth import list_keys

    with _key_session(data_dir) as session:
        rows = list_keys(session, tenant)
    print("\t".join(("id", "tenant", "role", "user_ids", "agent_ids", "label", "created", "revoked")))
    for r in rows:
        print("\t".join((r.id, r.tenant_id, r.role, ",".join(r.user_ids) or "-", ",".join(r.agent_ids) or "-",
                         _shown(r.label or "-"), r.created_at.isoformat(timespec="seconds"),
                         r.revoked_at.isoformat(timespec="seconds") if r.revoked_at else "-")))


@keys_app.command("revoke")
def keys_revoke(key_id: str, data_dir: DataDir = None) -> None:
    """Revoke a key by its id (key_...). Servers on this data directory stop taking it at once;
    replicas elsewhere within MEMORY_SERVER_KEY_CACHE_SECONDS."""
    from memory_server.auth import record_revocation, revoke_key

    with _key_session(data_dir) as session:
        revoke_key(session, key_id)
    if not record_revocation(_settings(data_dir).data_dir, key_id):
        typer.echo("warning: servers on this data directory refuse the key once their key cache expires "
                   "(MEMORY_SERVER_KEY_CACHE_SECONDS), not at once", err=True)
    print(f"revoked {key_id}")


def main() -> None:
    from sqlalchemy.exc import DBAPIError

    try:
        app()
    except DBAPIError as exc:  # the database is down, missing or refuses us: say so, no traceback
        typer.echo(f"error: the database cannot be used: {str(exc.orig or exc).strip().splitlines()[0]}", err=True)
        raise SystemExit(1) from None
