"""Shared fixtures: the real MiniLM model once per session, SQLite and PostgreSQL, both index backends,
and a real uvicorn server on a free loopback port for the HTTP tests."""

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy
import uvicorn
from sqlmodel import Session

from memory_server.app import create_app
from memory_server.auth import Principal, create_key
from memory_server.config import Settings
from memory_server.embedding import Embedder
from memory_server.runtime import BOOTSTRAP_KEY_FILE, Runtime

# Set to an admin URL of a PostgreSQL server (e.g. postgresql://postgres@127.0.0.1:5432/postgres) to run
# every storage test on PostgreSQL too; each test then gets a throwaway database. CI sets it.
POSTGRES_URL = os.environ.get("MEMORY_SERVER_TEST_POSTGRES_URL")
DATABASES = ["sqlite"] + (["postgres"] if POSTGRES_URL else [])


# One ONNX export of the model for the whole run (CLI subprocesses find it through the env var).
MODEL_DIR = Path(os.environ.setdefault("MEMORY_SERVER_MODEL_DIR", str(Path.home() / ".cache" / "memory-server-tests")))


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder(model_dir=MODEL_DIR)


@pytest.fixture(params=DATABASES)
def database_url(request, tmp_path) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None  # the default: SQLite in the data directory
        return
    name = f"ms_test_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
                                     isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    base = POSTGRES_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def wait_for(condition, what: str, timeout: float = 90, pause: float = 0.05) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(pause)
    return True


def make_settings(data_dir: Path, database_url: str | None = None, qdrant_url: str | None = None, **extra) -> Settings:
    # No access log (its lines would go to the test run's own output): tests/test_access_log.py turns it on.
    values = {"data_dir": data_dir, "database_url": database_url, "qdrant_url": qdrant_url,
              "expiry_sweep_seconds": 0.5, "sync_interval_seconds": 0.2, "access_log": False}
    values.update(extra)
    return Settings(**values)


@pytest.fixture
def settings(tmp_path, database_url) -> Settings:
    return make_settings(tmp_path / "data", database_url)


@pytest.fixture
def runtime(settings, embedder) -> Iterator[Runtime]:
    rt = Runtime.open(settings, embedder=embedder)
    yield rt
    rt.close()


@pytest.fixture
def admin() -> Principal:
    return Principal(tenant_id="t1", key_id="key_test_admin", role="admin")


@dataclass
class LiveServer:
    url: str
    admin_key: str
    settings: Settings
    app: object

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def create_key(self, role: str = "agent", **restrictions) -> str:
        """A key in the bootstrap admin's tenant, made through the admin API."""
        with self.client() as c:
            response = c.post("/v1/admin/keys", json={"role": role, **restrictions})
            assert response.status_code == 201, response.text
            return response.json()["key"]

    def create_tenant_key(self, tenant: str, role: str = "agent", **restrictions) -> str:
        """A key in any tenant, made the way `memory-server keys create` does."""
        with Session(self.app.state.runtime.engine) as session:
            return create_key(session, tenant_id=tenant, role=role, **restrictions)[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # running in a thread
        pass


def start_server(settings: Settings, embedder: Embedder):
    """Start a real uvicorn server in a thread; returns (LiveServer, stop function)."""
    port = _free_port()
    app = create_app(settings, embedder=embedder)
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    key = (settings.data_dir / BOOTSTRAP_KEY_FILE).read_text().strip()

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return LiveServer(f"http://127.0.0.1:{port}", key, settings, app), stop


@pytest.fixture
def server(settings, embedder) -> Iterator[LiveServer]:
    live, stop = start_server(settings, embedder)
    yield live
    stop()
