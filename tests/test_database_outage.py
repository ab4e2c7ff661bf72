"""The database going away under a running server (PostgreSQL refusing connections): every route
that needs it answers 503 `unavailable`, not 500, /readyz says which check failed, and the server
carries on once the database is back. (Needs MEMORY_SERVER_TEST_POSTGRES_URL.)"""

import uuid

import pytest
import sqlalchemy

from conftest import POSTGRES_URL, make_settings, start_server

pytestmark = pytest.mark.skipif(not POSTGRES_URL, reason="needs MEMORY_SERVER_TEST_POSTGRES_URL")


@pytest.fixture
def outage(tmp_path):
    """(database URL, a function that turns connections to it off or on)."""
    name = f"ms_test_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
                                     isolation_level="AUTOCOMMIT")

    def connections(allowed: bool) -> None:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}'))
            if not allowed:  # and drop the server's pooled ones
                conn.execute(sqlalchemy.text(
                    f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))

    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    yield f"{POSTGRES_URL.rsplit('/', 1)[0]}/{name}", connections
    connections(True)
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("direct_routes", [True, False], ids=["direct", "fastapi"])
def test_a_database_outage_is_503_on_every_route_and_the_server_recovers(tmp_path, embedder, outage, direct_routes):
    url, connections = outage
    live, stop = start_server(make_settings(tmp_path / "data", url, direct_routes=direct_routes), embedder)
    try:
        with live.client() as c:
            memory = c.post("/v1/memories", json={"text": "Vera collects old maps", "user_id": "vera"}).json()
            memory_id = memory["results"][0]["id"]
            other_key = live.create_key(user_ids=["vera"])  # not yet verified, so not in the key cache
            connections(False)
            requests = [("POST", "/v1/memories", {"text": "Vera learns Dutch", "user_id": "vera"}),
                        ("POST", "/v1/memories/batch", {"items": [{"text": "Vera sails", "user_id": "vera"}]}),
                        ("POST", "/v1/memories/search", {"query": "maps", "user_id": "vera"}),
                        ("GET", "/v1/memories?user_id=vera", None), ("GET", f"/v1/memories/{memory_id}", None),
                        ("PATCH", f"/v1/memories/{memory_id}", {"text": "Vera sells old maps"}),
                        ("DELETE", f"/v1/memories/{memory_id}", None), ("DELETE", "/v1/memories?user_id=vera", None),
                        ("GET", f"/v1/memories/{memory_id}/history", None)]
            for method, path, body in requests:
                response = c.request(method, path, json=body)
                assert response.status_code == 503, (method, path, response.text)
                assert response.json()["error"]["code"] == "unavailable"
                assert "database is unavailable" in response.json()["error"]["message"]
            with live.client(other_key) as fresh:  # its key cannot be checked either
                assert fresh.get("/v1/memories").status_code == 503
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["database"] is False
            connections(True)
            assert c.get("/readyz").status_code == 200
            hits = c.post("/v1/memories/search", json={"query": "maps", "user_id": "vera"}).json()["results"]
            assert [(h["id"], h["memory"]) for h in hits] == [(memory_id, "Vera collects old maps")]  # unchanged
            assert [e["event"] for e in c.get(f"/v1/memories/{memory_id}/history").json()["results"]] == ["ADD"]
            assert c.post("/v1/memories", json={"text": "Vera learns Dutch", "user_id": "vera"}).status_code == 200
    finally:
        stop()
