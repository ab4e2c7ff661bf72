"""How the app serves its routes."""

import inspect
from pathlib import Path

import httpx
import pytest

from memory_server.app import ROUTERS


def test_every_route_is_async_so_its_response_is_not_validated_in_a_second_thread_pool_hop():
    # FastAPI validates a plain `def` route's return value in the thread pool, a second hop per
    # request that under load queues again behind every waiting request; routes hand their
    # blocking work to the pool themselves (memory_server/api/deps.py).
    routes = [route for router in ROUTERS for route in router.routes]
    assert len(routes) >= 10
    assert [route.path for route in routes if not inspect.iscoroutinefunction(route.endpoint)] == []


def _stages(response) -> dict[str, float]:
    """The Server-Timing header as {stage: milliseconds}."""
    out = {}
    for part in response.headers["server-timing"].split(","):
        name, _, duration = part.strip().partition(";dur=")
        out[name] = float(duration)
    return out


def test_responses_say_where_their_time_went_in_a_server_timing_header(server):
    with server.client() as c:
        added = c.post("/v1/memories", json={"text": "Alice keeps bees on her roof", "user_id": "alice"})
        found = c.post("/v1/memories/search", json={"query": "who keeps bees?", "user_id": "alice"})
        keyword = c.post("/v1/memories/search", json={"query": "bees", "user_id": "alice", "mode": "keyword"})
        refused = c.post("/v1/memories/search", json={"query": "bees"})
    assert added.status_code == 200 and found.status_code == 200 and keyword.status_code == 200
    assert found.json()["results"][0]["memory"] == "Alice keeps bees on her roof"
    add, search, keyword_search = _stages(added), _stages(found), _stages(keyword)
    # The stages of a request thread land on the request's own timings (the pool copies the context).
    assert {"queue", "embed", "db", "index", "respond", "app"} <= add.keys()
    assert {"queue", "embed", "db", "index", "respond", "app"} <= search.keys()
    # The keyword search finds the memory the search before it read: its row comes from the row
    # cache (index_sync.RowCache), no database stage.
    assert "embed" not in keyword_search and "db" not in keyword_search
    assert {"queue", "index", "respond", "app"} <= keyword_search.keys()
    for stages in (add, search, keyword_search):
        assert all(value >= 0 for value in stages.values())
        # Stages run one after another inside the request, so together they fit in its whole time.
        assert sum(v for name, v in stages.items() if name != "app") <= stages["app"] + 0.05
    assert refused.status_code == 422 and set(_stages(refused)) >= {"app"}


def test_the_model_and_request_threads_carry_their_names_in_the_operating_system(server):
    # `top -H`, /proc and the HTTP benchmark's CPU split tell the model's threads from the request
    # threads by these names (Python 3.11 leaves every thread named after the process).
    with server.client() as c:
        assert c.post("/v1/memories/search", json={"query": "who keeps bees?", "user_id": "alice"}).status_code == 200
    names = {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
    assert "embedding-batch" in names  # embedding-batcher-N, cut to the 15 characters Linux keeps
    assert "request_0" in names and "memory-server-m" in names


def _stage_counts(metrics_text: str, route: str) -> dict[str, float]:
    """{stage: requests counted} of one route in the stage histogram of a /metrics page."""
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith("memory_server_http_request_stage_seconds_count{") and f'route="{route}"' in line:
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            counts[stage] = float(line.rsplit(" ", 1)[1])
    return counts


def test_metrics_count_requests_and_their_stages_for_admins_only(server):
    agent = server.create_key()
    with server.client(agent) as c:
        assert c.post("/v1/memories", json={"text": "Alice keeps bees", "user_id": "alice"}).status_code == 200
        for query in ("who keeps bees?", "honey"):
            assert c.post("/v1/memories/search", json={"query": query, "user_id": "alice"}).status_code == 200
        refused = c.get("/metrics")
    assert refused.status_code == 403
    with server.client() as c:
        page = c.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    text = page.text
    assert 'memory_server_http_requests_total{method="POST",route="/v1/memories/search",status="200"} 2.0' in text
    assert 'memory_server_http_requests_total{method="GET",route="/metrics",status="403"} 1.0' in text
    stages = _stage_counts(text, "/v1/memories/search")
    # The second search finds the memory the first one read: its row comes from the row cache
    # (index_sync.RowCache), no database stage.
    assert stages["queue"] == stages["embed"] == stages["index"] == stages["respond"] == 2 and stages["db"] == 1
    assert "app" not in stages  # the whole request is memory_server_http_request_seconds
    assert "memory_server_index_points" in text
    assert "memory_server_index_left_out 0.0" in text


def test_the_server_timing_header_can_be_turned_off_and_the_stages_are_still_counted(tmp_path, embedder):
    from conftest import make_settings, start_server

    live, stop = start_server(make_settings(tmp_path, server_timing=False), embedder)
    try:
        with live.client() as c:
            response = c.post("/v1/memories/search", json={"query": "bees", "user_id": "alice"})
            text = c.get("/metrics").text
        assert response.status_code == 200 and "server-timing" not in response.headers
        assert _stage_counts(text, "/v1/memories/search")["embed"] == 1
    finally:
        stop()


def test_stages_cost_nothing_and_record_nothing_outside_a_timed_request():
    from memory_server.timing import Timings, stage, timed_iter, timed_request

    with stage("embed"):
        pass
    assert list(timed_iter("embed", iter([1, 2]))) == [1, 2]
    with timed_request() as timings:
        with stage("db"):
            pass
        with stage("db"):
            pass
        assert list(timed_iter("embed", iter([1, 2]))) == [1, 2]
    assert isinstance(timings, Timings) and set(timings.stages) == {"db", "embed"}
    finished = timings.finish()
    assert list(finished) == ["db", "embed", "app"] and finished["app"] >= finished["db"] + finished["embed"]
    parts = Timings.header(finished).decode().split(", ")
    assert [p.split(";")[0] for p in parts] == ["db", "embed", "app"] and all(";dur=" in p for p in parts)
    assert parts[-1] == f"app;dur={finished['app'] * 1000:.2f}"


def _comparable(value):
    """A response's JSON without what differs between two stores: ids, times and scores (a keyword
    score carries its memory id's tie-break: storage/vectors/sparse.py; _scores compares them)."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in ("id", "created_at", "updated_at", "score")}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _scores(value) -> list[float]:
    """Every score in a response's JSON, in order."""
    if isinstance(value, dict):
        return [value["score"]] if "score" in value else [s for v in value.values() for s in _scores(v)]
    if isinstance(value, list):
        return [s for v in value for s in _scores(v)]
    return []


# (method, path, body as JSON or raw bytes, content type): good requests and bad ones for each direct route.
SAME_BOTH_WAYS = [
    ("POST", "/v1/memories", {"text": "Alice keeps bees on her roof", "user_id": "alice", "metadata": {"n": 1}}, None),
    ("POST", "/v1/memories/batch", {"items": [{"text": "Alice likes green tea", "user_id": "alice"},
                                              {"text": "Bob rides a red bike", "user_id": "bob"}]}, None),
    ("POST", "/v1/memories/search", {"query": "who keeps bees?", "user_id": "alice"}, None),
    ("POST", "/v1/memories/search", {"query": "tea", "user_id": "alice", "mode": "keyword", "top_k": 1}, None),
    ("POST", "/v1/memories/search", {"query": "bike", "filters": {"user_id": "bob"}, "mode": "dense"}, None),
    ("POST", "/v1/memories", {"text": "", "user_id": "alice"}, None),
    ("POST", "/v1/memories", {"text": "x", "user_id": "alice", "metadata": [1]}, None),
    ("POST", "/v1/memories/batch", {"items": [{"text": "ok", "user_id": "a"}, {"text": 5, "user_id": "a"}]}, None),
    ("POST", "/v1/memories/search", {"query": "bees", "top_k": 0, "user_id": "alice"}, None),
    ("POST", "/v1/memories/search", {"query": "bees"}, None),
    ("POST", "/v1/memories/search", b'{"query": "bees", ', "application/json"),
    ("POST", "/v1/memories/search", b"[1, 2]", "application/json"),
    ("POST", "/v1/memories", b"", "application/json"),
    ("POST", "/v1/memories", b'{"text": "Alice keeps bees", "user_id": "alice"}', "text/plain"),
    ("POST", "/v1/memories", b'{"text": "Alice keeps bees", "user_id": "alice"}', None),
    ("POST", "/v1/memories", b'{"text": "Alice keeps bees", "user_id": "alice"}', "application/vnd.api+json"),
    ("GET", "/v1/memories/search", None, None),
]


def test_direct_routes_answer_exactly_as_fastapi_does(tmp_path, embedder):
    from conftest import make_settings, start_server

    answers, scores = {}, {}
    for direct in (True, False):
        live, stop = start_server(make_settings(tmp_path / str(direct), direct_routes=direct), embedder)
        try:
            with live.client() as c:
                responses = []
                for method, path, body, content_type in SAME_BOTH_WAYS:
                    headers = {"Content-Type": content_type} if content_type else {}
                    if isinstance(body, bytes):
                        response = c.request(method, path, content=body, headers=headers)
                    else:
                        response = c.request(method, path, json=body)
                    responses.append((response.status_code, response.headers["content-type"],
                                      _comparable(response.json())))
                    scores[direct] = scores.get(direct, []) + _scores(response.json())
                metrics = c.get("/metrics").text
        finally:
            stop()
        answers[direct] = responses
        # Requests answered directly are counted under their route, like FastAPI's.
        assert 'memory_server_http_requests_total{method="POST",route="/v1/memories/search",status="200"} 3.0' in metrics
    assert answers[True] == answers[False]
    assert len(scores[True]) >= 2 and scores[True] == pytest.approx(scores[False], abs=0.005)
    statuses = [status for status, _, _ in answers[True]]
    assert statuses == [200, 200, 200, 200, 200, 422, 422, 422, 422, 422, 400, 422, 422, 422, 422, 200, 404]
    assert answers[True][2][2]["results"][0]["memory"] == "Alice keeps bees on her roof"


@pytest.mark.parametrize("direct", [True, False])
def test_the_model_gets_only_the_texts_of_requests_that_pass_their_checks(tmp_path, embedder, monkeypatch, direct):
    """A search's query and an add's text go to the model as the request arrives, on the event loop
    (api/memories.py), after the request's checks: a refused one is never embedded."""
    import uuid

    from conftest import make_settings, start_server

    handed, submit = [], embedder._batcher.submit
    monkeypatch.setattr(embedder._batcher, "submit", lambda texts: handed.append(list(texts)) or submit(texts))
    fresh = uuid.uuid4().hex  # texts the query cache has never seen
    live, stop = start_server(make_settings(tmp_path, direct_routes=direct), embedder)
    try:
        with live.client() as c:
            refused = [c.post("/v1/memories", json={"text": f"a fact of no one {fresh}"}),
                       c.post("/v1/memories", json={"text": f"a fact {fresh}", "user_id": "alice",
                                                    "expires_at": "2001-01-01T00:00:00Z"}),
                       c.post("/v1/memories/search", json={"query": f"bees {fresh}", "top_k": 0, "user_id": "alice"}),
                       c.post("/v1/memories/search", json={"query": f"bees {fresh}"})]
            assert [r.status_code for r in refused] == [422, 422, 422, 422]
            assert handed == []
            added = c.post("/v1/memories", json={"text": f"Alice keeps bees {fresh}", "user_id": "alice"})
            found = c.post("/v1/memories/search", json={"query": f"who keeps bees {fresh}", "user_id": "alice"})
            keyword = c.post("/v1/memories/search", json={"query": f"bees {fresh}", "user_id": "alice",
                                                          "mode": "keyword"})
    finally:
        stop()
    assert added.status_code == 200 and "embed;dur=" in added.headers["server-timing"]
    assert handed == [[f"Alice keeps bees {fresh}"], [f"who keeps bees {fresh}"]]  # the keyword search embeds nothing
    assert found.json()["results"][0]["memory"] == f"Alice keeps bees {fresh}"
    assert keyword.json()["results"][0]["memory"] == f"Alice keeps bees {fresh}"


@pytest.mark.parametrize("direct", [True, False])
def test_a_model_failure_is_a_503_over_http(tmp_path, embedder, monkeypatch, direct):
    from conftest import make_settings, start_server

    def out_of_memory(texts):
        raise RuntimeError("the model ran out of memory")
        yield

    live, stop = start_server(make_settings(tmp_path, direct_routes=direct), embedder)
    try:
        with live.client() as c:
            monkeypatch.setattr(embedder._batcher, "_encode_parts", out_of_memory)  # the micro-batches' model call
            answers = [c.post("/v1/memories", json={"text": "Alice keeps a fact the model fails on", "user_id": "alice"}),
                       c.post("/v1/memories/search", json={"query": "a query the model fails on", "user_id": "alice"})]
            monkeypatch.undo()
            assert c.get("/v1/memories", params={"user_id": "alice"}).json()["results"] == []
    finally:
        stop()
    for response in answers:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "unavailable"
        assert "embedding model failed" in response.json()["error"]["message"]


def test_a_direct_route_checks_the_key_before_it_reads_the_body(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        response = anonymous.post("/v1/memories/search", content=b'{"query": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"


def test_a_running_server_keeps_its_startup_objects_out_of_the_collectors_sight(tmp_path, embedder):
    # A full collection walks every tracked object while the whole process waits; what the server
    # holds from its start (model, engine, schemas) is frozen, and handed back when it stops.
    import gc

    from conftest import make_settings, start_server

    live, stop = start_server(make_settings(tmp_path), embedder)
    try:
        assert gc.get_freeze_count() > 10_000
        with live.client() as c:
            assert c.post("/v1/memories/search", json={"query": "bees", "user_id": "alice"}).status_code == 200
    finally:
        stop()
    assert gc.get_freeze_count() == 0


def test_health_and_readiness_answer_head_as_load_balancers_probe(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for path in ("/healthz", "/readyz"):
            response = anonymous.head(path)
            assert response.status_code == 200 and response.content == b"", (path, response.status_code)
            assert anonymous.get(path).status_code == 200


def test_a_database_error_that_an_outage_caused_is_an_outage():
    """In an outage SQLAlchemy's pre-ping met a socket closed mid-ping (psycopg's OperationalError),
    then failed to restore autocommit and raised a ProgrammingError: that was a 500 (seen once in
    tests/test_database_outage.py). Such an error is answered 503 like the outage itself."""
    import sqlite3

    import psycopg
    from sqlalchemy.exc import ProgrammingError

    from memory_server.api.responses import caused_by_outage

    try:
        try:
            raise psycopg.OperationalError("connection socket closed")
        except psycopg.OperationalError:
            raise psycopg.ProgrammingError("can't change 'autocommit' now: connection in transaction status ACTIVE")
    except psycopg.ProgrammingError as exc:
        try:
            raise ProgrammingError("SELECT 1", {}, exc) from exc
        except ProgrammingError as wrapped:
            in_ping = wrapped
    assert caused_by_outage(in_ping)
    assert caused_by_outage(sqlite3.OperationalError("database is locked"))
    # The driver's own subclasses, raised unwrapped by the SQL run on its cursor (storage/db.py
    # driver_rows): a backend terminated mid-request was a 500 (a review, session 28).
    assert caused_by_outage(psycopg.errors.AdminShutdown("terminating connection due to administrator command"))
    assert caused_by_outage(psycopg.errors.ConnectionTimeout("connection timeout expired"))
    assert not caused_by_outage(ProgrammingError("SELEC 1", {}, psycopg.ProgrammingError("syntax error")))
