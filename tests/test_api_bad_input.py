"""Bad input over HTTP: every case gets its 4xx and the error JSON naming the field, and nothing is half-written.

Every test runs twice: with add, batch add and search answered ahead of FastAPI (memory_server/api/direct.py,
the default) and with FastAPI answering every route.
"""

import base64
import json
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from conftest import make_settings

MAX_BODY = 1024 * 1024
MAX_TEXT = 32 * 1024
PAST = "2000-01-01T00:00:00Z"
USER_MESSAGE = {"role": "user", "content": "I like green tea"}
MODES = ("hybrid", "dense", "keyword")


# -- helpers ---------------------------------------------------------------------------------------
def expect_status(response: httpx.Response, *statuses: int) -> httpx.Response:
    if response.status_code >= 500:
        # The server thread is still printing its traceback. On Python 3.11 that and pytest's failure report both
        # run ast.parse, which races between threads (cpython#106905) and can abort the whole pytest session.
        time.sleep(1)
    assert response.status_code in statuses, response.text
    return response


def assert_error(response: httpx.Response, status: int, field: str | None = None, code: str | None = None) -> None:
    body = expect_status(response, status).json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"code", "message", "field"}, error
    assert error["message"], error
    assert error["field"] == field, error
    if code is not None:
        assert error["code"] == code, error


def add_body(**fields) -> dict:
    """A valid add body for user u1; a field given as None is left out."""
    body = {"text": "I like green tea", "user_id": "u1", **fields}
    return {k: v for k, v in body.items() if v is not None}


def add(client: httpx.Client, text: str = "I like green tea", **scope) -> dict:
    response = client.post("/v1/memories", json={"text": text, **(scope or {"user_id": "u1"})})
    (result,) = expect_status(response, 200).json()["results"]
    return client.get(f"/v1/memories/{result['id']}").json()


def assert_nothing_stored(client: httpx.Client) -> None:
    """The admin key sees the whole tenant: neither listing nor any search mode finds a memory."""
    listed = expect_status(client.get("/v1/memories", params={"limit": 200}), 200)
    assert listed.json()["results"] == [], listed.text
    for mode in MODES:
        found = client.post("/v1/memories/search", json={"query": "green tea", "user_id": "u1", "mode": mode})
        assert expect_status(found, 200).json()["results"] == [], (mode, found.text)


def assert_unchanged(client: httpx.Client, before: dict) -> None:
    after = expect_status(client.get(f"/v1/memories/{before['id']}"), 200)
    assert after.json() == before, after.text
    history = client.get(f"/v1/memories/{before['id']}/history").json()["results"]
    assert [entry["event"] for entry in history] == ["ADD"]


def post_raw(client: httpx.Client, path: str, content, method: str = "POST") -> httpx.Response:
    return client.request(method, path, content=content, headers={"Content-Type": "application/json"})


def cursor_of(value) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


@pytest.fixture(params=["direct", "fastapi"])
def settings(request, tmp_path, database_url):
    return make_settings(tmp_path / "data", database_url, direct_routes=request.param == "direct")


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


# -- authentication and authorization -------------------------------------------------------------
def test_request_without_authorization_header_is_401(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert_error(anonymous.get("/v1/memories"), 401, code="unauthorized")
        assert_error(anonymous.post("/v1/memories", json=add_body()), 401, code="unauthorized")
    assert_nothing_stored(client)


MALFORMED_AUTHORIZATION = ["Basic dXNlcjpwYXNz", "Bearer", "{key}", "Bearer{key}", "Key {key}",
                           "Bearer {key}x", "Bearer x{key}"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
def test_a_request_without_a_valid_key_is_refused_before_its_body_is_sent(tmp_path, embedder, direct):
    """The hot routes (api/direct.py) read the whole body and only then checked the key, and FastAPI's
    own routes read (and parsed) a body before they resolved the key dependency: a client that asked
    `Expect: 100-continue` was told to send it, and an unauthenticated client could make the server take
    in a body up to the size limit. The key is now verified first on every /v1/ route (app.py KeyFirst),
    a chunked body included."""
    import socket

    from conftest import start_server

    server, stop = start_server(make_settings(tmp_path / "data", direct_routes=direct), embedder)
    host, port = server.url.removeprefix("http://").split(":")
    requests = [(f"POST {path}", "Content-Length: 100000")
                for path in ("/v1/memories", "/v1/memories/batch", "/v1/memories/search", "/v1/admin/keys")]
    requests += [("PATCH /v1/memories/00000000-0000-0000-0000-000000000000", "Content-Length: 100000"),
                 ("POST /v1/memories/search", "Transfer-Encoding: chunked"),
                 ("DELETE /v1/memories?user_id=u1", "Content-Length: 5000")]
    try:
        for request_line, length in requests:
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(f"{request_line} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Authorization: Bearer msk_not_a_key\r\nExpect: 100-continue\r\n{length}\r\n\r\n".encode())
                sock.settimeout(10)
                head = sock.recv(65536)
            # At once: no body sent, no 100 Continue first.
            assert head.startswith(b"HTTP/1.1 401 "), (request_line, head[:200])
            assert b'"code":"unauthorized"' in head, (request_line, head)
            # The body was never read: the connection cannot carry another request (the next one would
            # be taken as that body), so the server closes it.
            assert b"\r\nconnection: close\r\n" in head.lower(), (request_line, head[:400])
        # A request without a body keeps its connection; the 401 is counted under its route.
        with httpx.Client(base_url=server.url) as anonymous:
            assert_error(anonymous.get("/v1/memories/abc"), 401, code="unauthorized")
            response = anonymous.get("/v1/memories", params={"user_id": "u1"})
            assert_error(response, 401, code="unauthorized")
            assert response.headers.get("connection") != "close"
        metrics = server.app.state.metrics.requests
        assert metrics.labels("GET", "/v1/memories/{memory_id}", "401")._value.get() == 1
    finally:
        stop()


def test_paths_with_a_trailing_slash_are_404_not_redirected(client):
    """A 307 to the path without its slash is followed with the same method by httpx and requests:
    `DELETE /v1/memories/?user_id=u1` (a memory id left empty) deleted every memory of u1."""
    memory = add(client)
    for method, path in (("DELETE", "/v1/memories/?user_id=u1"), ("DELETE", "/v1/memories/%2F?user_id=u1"),
                         ("GET", "/v1/memories/?user_id=u1"), ("POST", "/v1/memories/search/")):
        response = client.request(method, path, json={"query": "tea", "user_id": "u1"} if method == "POST" else None,
                                  follow_redirects=True)
        assert response.status_code in (404, 405) and not response.history, (method, path, response.status_code)
    assert_unchanged(client, memory)


def test_malformed_authorization_header_is_401(server, client, subtests):
    for header in MALFORMED_AUTHORIZATION:
        with subtests.test(header=header), httpx.Client(
                base_url=server.url, headers={"Authorization": header.format(key=server.admin_key)}, timeout=30) as c:
            assert_error(c.post("/v1/memories", json=add_body()), 401, code="unauthorized")
    assert_nothing_stored(client)


def test_both_bearer_and_token_schemes_carry_a_valid_key(server):
    for scheme in ("Bearer", "Token", "bearer"):
        headers = {"Authorization": f"{scheme} {server.admin_key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
            expect_status(c.get("/v1/memories"), 200)


def test_unknown_key_is_401(server, client):
    for header in ("Bearer msk_" + "A" * 43, "Token msk_" + "A" * 43, "Bearer not-a-key"):
        with httpx.Client(base_url=server.url, headers={"Authorization": header}, timeout=30) as c:
            assert_error(c.post("/v1/memories", json=add_body()), 401, code="unauthorized")
    assert_nothing_stored(client)


def test_revoked_key_is_401(server, client):
    created = client.post("/v1/admin/keys", json={"role": "agent"}).json()
    expect_status(client.delete(f"/v1/admin/keys/{created['id']}"), 200)
    with server.client(created["key"]) as revoked:
        assert_error(revoked.post("/v1/memories", json=add_body()), 401, code="unauthorized")
        assert_error(revoked.get("/v1/memories"), 401, code="unauthorized")
    assert_nothing_stored(client)


def test_agent_key_on_admin_keys_api_is_403(server, client):
    with server.client(server.create_key("agent")) as agent:
        assert_error(agent.get("/v1/admin/keys"), 403, code="forbidden")
        assert_error(agent.post("/v1/admin/keys", json={"role": "admin"}), 403, code="forbidden")
        own_id = client.get("/v1/admin/keys").json()["results"][0]["id"]
        assert_error(agent.delete(f"/v1/admin/keys/{own_id}"), 403, code="forbidden")


def test_a_key_label_of_more_than_one_line_is_422(client, subtests):
    """`keys list` prints one tab-separated line per key: the CLI refused such labels, the API took them."""
    for label in ("two\tcolumns", "two\nlines", "bell\x07", "line\u2028separator"):
        with subtests.test(repr(label)):
            response = client.post("/v1/admin/keys", json={"role": "agent", "label": label})
            assert_error(response, 422, "label", "invalid_input")
            assert response.json()["error"]["message"].startswith("label: must not contain control characters")
    assert expect_status(client.post("/v1/admin/keys", json={"role": "agent", "label": "Café ops — laptop"}), 201)


def test_revoking_a_key_id_with_a_nul_or_of_another_form_is_404(client, subtests):
    """PostgreSQL refuses a NUL in a text parameter: `DELETE /v1/admin/keys/key_%00` was a 500 there."""
    for key_id in ("key_%00", "a%00b", "key_0123456789abcdef", "key_" + "f" * 200, "%F0%9F%94%91"):
        with subtests.test(key_id):
            response = client.delete(f"/v1/admin/keys/{key_id}")
            assert_error(response, 404, code="not_found")
            assert len(response.json()["error"]["message"]) < 100
    own_id = client.get("/v1/admin/keys").json()["results"][0]["id"]
    assert client.get("/v1/admin/keys").json()["results"][0]["revoked_at"] is None, own_id


def test_a_message_role_with_control_characters_is_422_and_stores_nothing(client, subtests):
    """The role is kept in the memory's metadata, where NUL is refused: a role "as\\x00st" was stored,
    and then neither a PATCH sending that metadata back nor a filter on it was accepted."""
    for role in ("as\x00st", "user\n", "tab\there"):
        message = {"role": role, "content": "I like green tea"}
        with subtests.test(role=role):
            assert_error(client.post("/v1/memories", json=add_body(text=None, messages=[message])), 422,
                         "messages[0].role", "invalid_input")
            response = client.post("/v1/memories/batch", json={"items": [add_body(), add_body(
                text=None, messages=[USER_MESSAGE, message])]})
            assert_error(response, 422, "items[1].messages[1].role", "invalid_input")
    assert_nothing_stored(client)


def test_a_batch_item_outside_a_restricted_keys_scope_is_403_naming_the_item(server):
    with server.client(server.create_key("agent", user_ids=["alice"])) as alice:
        response = alice.post("/v1/memories/batch", json={"items": [add_body(user_id="alice"), add_body(user_id="bob")]})
        assert_error(response, 403, "items[1].user_id", "forbidden")
        assert_error(alice.post("/v1/memories", json=add_body(user_id="bob")), 403, "user_id", "forbidden")
        assert alice.get("/v1/memories").json()["results"] == []  # all or nothing


def test_a_key_restricted_to_more_than_1000_ids_is_422_and_1000_work(server, client):
    """Each restricted id is one SQL parameter of a listing or a scope delete: 70,000 of them made
    every listing with that key fail on PostgreSQL (65,535 parameters at most)."""
    keys_before = client.get("/v1/admin/keys").json()["results"]
    for field in ("user_ids", "agent_ids"):
        response = client.post("/v1/admin/keys", json={"role": "agent", field: [f"id{n}" for n in range(1001)]})
        assert_error(response, 422, field, "invalid_input")
    assert client.get("/v1/admin/keys").json()["results"] == keys_before
    key = server.create_key(user_ids=[f"u{n}" for n in range(1000)])
    with server.client(key) as restricted:
        expect_status(restricted.post("/v1/memories", json=add_body(user_id="u999")), 200)
        assert [m["user_id"] for m in expect_status(restricted.get("/v1/memories"), 200).json()["results"]] == ["u999"]
        found = restricted.post("/v1/memories/search", json={"query": "green tea", "mode": "keyword"})
        assert [m["user_id"] for m in expect_status(found, 200).json()["results"]] == ["u999"]
        assert expect_status(restricted.delete("/v1/memories", params={"user_id": "u999"}), 200).json() == {"deleted": 1}


# -- sizes -----------------------------------------------------------------------------------------
def test_body_over_one_mib_with_content_length_is_413(client):
    body = json.dumps(add_body(text="a" * MAX_BODY)).encode()
    assert len(body) > MAX_BODY
    response = post_raw(client, "/v1/memories", body)
    assert_error(response, 413, code="payload_too_large")
    assert_nothing_stored(client)


def test_chunked_body_over_one_mib_is_413(client):
    def chunks():  # no Content-Length: httpx sends Transfer-Encoding: chunked
        yield b'{"user_id": "u1", "text": "'
        for _ in range(MAX_BODY // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    response = post_raw(client, "/v1/memories", chunks())
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert_error(response, 413, code="payload_too_large")
    assert_nothing_stored(client)


def test_memory_text_over_32_kib_is_422(client):
    too_long = {"ascii": "a" * (MAX_TEXT + 1), "multi-byte": "é" * (MAX_TEXT // 2 + 1)}  # the limit is in bytes
    for text in too_long.values():
        assert_error(client.post("/v1/memories", json=add_body(text=text)), 422, "text", "invalid_input")
    message = {"role": "user", "content": "a" * (MAX_TEXT + 1)}
    response = client.post("/v1/memories", json=add_body(text=None, messages=[USER_MESSAGE, message]))
    assert_error(response, 422, "messages[1].content")
    assert_nothing_stored(client)
    expect_status(client.post("/v1/memories", json=add_body(text="a" * MAX_TEXT)), 200)


# -- add -------------------------------------------------------------------------------------------
ADD_CASES = [
    ("empty text", add_body(text=""), "text"),
    ("whitespace-only text", add_body(text=" \n\t  "), "text"),
    ("text not a string", add_body(text=42), "text"),
    ("both text and messages", add_body(messages=[USER_MESSAGE]), "messages"),
    ("neither text nor messages", add_body(text=None), "messages"),
    ("empty messages", add_body(text=None, messages=[]), "messages"),
    ("only system messages", add_body(text=None, messages=[{"role": "system", "content": "be brief"}]), "messages"),
    ("one empty message among good ones",
     add_body(text=None, messages=[USER_MESSAGE, {"role": "user", "content": "   "}]), "messages[1].content"),
    ("no scope id", add_body(user_id=None), "user_id"),
    ("user_id with a space", add_body(user_id="a b"), "user_id"),
    ("user_id with a slash", add_body(user_id="x/y"), "user_id"),
    ("agent_id of 129 characters", add_body(agent_id="a" * 129), "agent_id"),
    ("empty run_id", add_body(run_id=""), "run_id"),
    ("user_id not a string", add_body(user_id=7), "user_id"),
    ("metadata a list", add_body(metadata=["topic", "tea"]), "metadata"),
    ("infer not a boolean", add_body(infer="maybe"), "infer"),
    ("infer a number", add_body(infer=1), "infer"),
    ("expires_at in the past", add_body(expires_at=PAST), "expires_at"),
    ("expires_at not a time", add_body(expires_at="next tuesday"), "expires_at"),
]


def test_add_with_bad_body_is_422_naming_the_field(client, subtests):
    for name, body, field in ADD_CASES:
        with subtests.test(name):
            assert_error(client.post("/v1/memories", json=body), 422, field, "invalid_input")
    assert_nothing_stored(client)


def test_malformed_json_is_400(client, subtests):
    for path in ("/v1/memories", "/v1/memories/batch", "/v1/memories/search"):
        for content in (b'{"text": "I like tea", "user_id": ', b"{'text': 'single quotes'}", b"\xff\xfe"):
            with subtests.test(path=path, content=content):
                assert_error(post_raw(client, path, content), 400, None, "malformed_json")
    assert_nothing_stored(client)


def test_json_body_that_is_not_an_object_is_422(client, subtests):
    for content in (b"[1, 2]", b'"I like tea"', b"null", b"42"):
        with subtests.test(content=content):
            assert_error(post_raw(client, "/v1/memories", content), 422, None, "invalid_input")
    assert_nothing_stored(client)


def test_memory_text_with_nul_byte_is_stored_or_refused_never_500(client):
    # PostgreSQL text cannot hold NUL: the server must refuse it (naming `text`) or store it, not crash.
    response = client.post("/v1/memories", json=add_body(text="green\x00tea"))
    if expect_status(response, 200, 422).status_code == 422:
        assert_error(response, 422, "text")
        assert_nothing_stored(client)
    else:
        memory_id = response.json()["results"][0]["id"]
        assert client.get(f"/v1/memories/{memory_id}").json()["memory"] == "green\x00tea"


def test_expires_at_beyond_the_datetime_range_in_utc_is_not_a_500(client):
    # Valid ISO times whose UTC form falls outside Python's datetime range (years 1-9999).
    for expires_at in ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+01:00"):
        response = client.post("/v1/memories", json=add_body(expires_at=expires_at))
        if expect_status(response, 200, 422).status_code == 422:  # a far-future time may be accepted; never a 500
            assert_error(response, 422, "expires_at")
    assert_nothing_stored(client)


# JSON's escapes can spell what no store holds: a lone surrogate ("\ud800": valid JSON, no UTF-8
# form), NaN and Infinity (Python's parser reads them; PostgreSQL refuses them). Written as raw bodies,
# since a JSON encoder will not produce them. One such memory once wedged the vector index for
# everyone: it was stored, and then no catch-up could apply it.
RAW_ADD_CASES = [
    ("lone surrogate in text", r'{"text": "green \ud800 tea", "user_id": "u1"}', "text"),
    ("lone low surrogate in a message", r'{"messages": [{"role": "user", "content": "hi \udfff"}], "user_id": "u1"}',
     "messages[0].content"),
    ("lone surrogate in a metadata value", r'{"text": "tea", "user_id": "u1", "metadata": {"k": "v\ud800"}}',
     "metadata"),
    ("lone surrogate in a metadata key", r'{"text": "tea", "user_id": "u1", "metadata": {"k\udc00": "v"}}', "metadata"),
    ("lone surrogate in a message's metadata",
     r'{"messages": [{"role": "user", "content": "hi", "metadata": {"k": ["\ud800"]}}], "user_id": "u1"}',
     "messages[0].metadata"),
    ("lone surrogate in user_id", r'{"text": "tea", "user_id": "u\ud800"}', "user_id"),
    ("NaN in metadata", '{"text": "tea", "user_id": "u1", "metadata": {"n": NaN}}', "metadata"),
    ("Infinity in metadata", '{"text": "tea", "user_id": "u1", "metadata": {"n": -Infinity}}', "metadata"),
    ("a number too large for a float in metadata", '{"text": "tea", "user_id": "u1", "metadata": {"n": 1e400}}',
     "metadata"),
]


def test_text_and_numbers_no_store_can_hold_are_422_and_store_nothing(client, subtests):
    for name, body, field in RAW_ADD_CASES:
        with subtests.test(name):
            assert_error(post_raw(client, "/v1/memories", body), 422, field, "invalid_input")
            batch = '{"items": [{"text": "fine", "user_id": "u1"}, ' + body + "]}"
            assert_error(post_raw(client, "/v1/memories/batch", batch), 422, f"items[1].{field}", "invalid_input")
    assert_nothing_stored(client)
    # A surrogate pair is one character, not a lone surrogate: stored, and found, as such.
    response = expect_status(post_raw(client, "/v1/memories", r'{"text": "tea time \ud83c\udf75", "user_id": "u1"}'), 200)
    assert response.json()["results"][0]["memory"] == "tea time \U0001f375"
    hits = client.post("/v1/memories/search", json=search_body(query="tea time")).json()["results"]
    assert [h["memory"] for h in hits] == ["tea time \U0001f375"]


def test_patch_with_a_lone_surrogate_or_nan_is_422_and_changes_nothing(client, subtests):
    before = add(client)
    for name, body, field in (("text", r'{"text": "x\udfff"}', "text"),
                              ("metadata value", r'{"metadata": {"k": "\ud800"}}', "metadata"),
                              ("metadata number", '{"metadata": {"k": NaN}}', "metadata")):
        with subtests.test(name):
            assert_error(post_raw(client, f"/v1/memories/{before['id']}", body, method="PATCH"), 422, field)
    assert_unchanged(client, before)


RAW_SEARCH_CASES = [
    ("lone surrogate in the query", r'{"query": "tea \ud800", "user_id": "u1"}', "query"),
    ("lone surrogate in a metadata filter",
     r'{"query": "tea", "filters": {"user_id": "u1", "metadata.k": "\ud800"}}', "filters.metadata.k"),
    ("lone surrogate in a metadata in-list",
     r'{"query": "tea", "filters": {"user_id": "u1", "metadata.k": {"in": ["a", "\ud800"]}}}', "filters.metadata.k.in"),
    ("lone surrogate in a metadata key of a filter",
     r'{"query": "tea", "filters": {"user_id": "u1", "metadata.k\ud800": 1}}', "filters.metadata.k\ud800"),
    ("lone surrogate in a scope filter", r'{"query": "tea", "filters": {"user_id": "\ud800"}}', "filters.user_id"),
    ("NaN in a range filter", '{"query": "tea", "filters": {"user_id": "u1", "metadata.n": {"lt": NaN}}}',
     "filters.metadata.n.lt"),
    ("Infinity as a filter value", '{"query": "tea", "filters": {"user_id": "u1", "metadata.n": Infinity}}',
     "filters.metadata.n"),
]


def test_search_with_text_or_numbers_no_store_can_hold_is_422_naming_the_field(client, subtests):
    add(client)
    for name, body, field in RAW_SEARCH_CASES:
        with subtests.test(name):
            assert_error(post_raw(client, "/v1/memories/search", body), 422, field.replace(r"\ud800", "\ud800"),
                         "invalid_input")


def test_deeply_nested_bodies_are_4xx_and_store_nothing(client, subtests):
    deep_filters = {"user_id": "u1"}
    for _ in range(40):
        deep_filters = {"NOT": deep_filters} if len(json.dumps(deep_filters)) % 2 else {"AND": [deep_filters]}
    response = client.post("/v1/memories/search", json=search_body(filters={"user_id": "u1", "AND": [deep_filters]}))
    assert_error(response, 422, code="invalid_input", field=response.json()["error"]["field"])
    assert "nested too deeply" in response.json()["error"]["message"]
    assert response.json()["error"]["field"].startswith("filters.AND[0].")
    nested = "[" * 50_000 + "]" * 50_000  # deeper than Python's JSON parser goes
    for path, body in (("/v1/memories", '{"text": "tea", "user_id": "u1", "metadata": {"a": ' + nested + "}}"),
                       ("/v1/memories/batch", '{"items": ' + nested + "}"),
                       ("/v1/memories/search", '{"query": "tea", "user_id": "u1", "filters": ' + nested + "}")):
        with subtests.test(path):
            assert_error(post_raw(client, path, body), 400, None, "bad_request")
    before = add(client)
    nested_metadata = '{"metadata": ' + '{"a": ' * 20_000 + "1" + "}" * 20_001
    assert_error(post_raw(client, f"/v1/memories/{before['id']}", nested_metadata, method="PATCH"), 400, None)
    assert_unchanged(client, before)


def test_filter_keys_and_ids_ending_in_a_newline_are_422(client, subtests):
    """A pattern ending in `$` also matches before a final newline: a metadata key "topic\\n" reached
    Qdrant, which refused it (a 500 with any key), and "u1\\n" passed as a user id (a fuzzing review,
    session 28)."""
    memory = add(client)
    cases = {"filters.metadata.topic\n": {"user_id": "u1", "metadata.topic\n": "food"},
             "filters.metadata.priority\n": {"user_id": "u1", "metadata": {"priority\n": {"gt": 1}}},
             "filters.NOT[0].metadata.x\n": {"user_id": "u1", "NOT": {"metadata.x\n": 1}},
             "filters.user_id": {"user_id": "u1\n"},
             "filters.user_id.in": {"user_id": {"in": ["u1", "u1\n"]}}}
    for field, filters in cases.items():
        for mode in MODES:
            with subtests.test(field=field, mode=mode):
                response = client.post("/v1/memories/search", json=search_body(filters=filters, mode=mode))
                assert_error(response, 422, field, "invalid_input")
    assert_unchanged(client, memory)


def test_an_empty_metadata_object_in_filters_is_422(client, subtests):
    """`{"metadata": {}}` added no condition: alone it matched everything, under NOT nothing."""
    add(client)
    for field, filters in (("filters.metadata", {"user_id": "u1", "metadata": {}}),
                           ("filters.NOT[0].metadata", {"user_id": "u1", "NOT": {"metadata": {}}}),
                           ("filters.OR[0].metadata", {"user_id": "u1", "OR": [{"metadata": {}}]})):
        with subtests.test(field):
            assert_error(client.post("/v1/memories/search", json=search_body(filters=filters)), 422, field,
                         "invalid_input")


def test_filters_with_too_many_terms_are_422_and_a_1000_id_list_works(client, subtests):
    memory = add(client, user_id="u1", metadata={"n": 7})
    ids = [f"u{i}" for i in range(2, 1001)] + ["u1"]
    found = client.post("/v1/memories/search", json=search_body(filters={"user_id": {"in": ids}}))
    assert [hit["id"] for hit in expect_status(found, 200).json()["results"]] == [memory["id"]]
    numbers = list(range(100_000))  # ~600 KB: seconds of CPU before the cap
    too_many = {
        "one long in list": {"user_id": "u1", "metadata.n": {"in": numbers}},
        "many conditions": {"user_id": "u1", "OR": [{"metadata.n": n} for n in range(3000)]},
        "spread over levels": {"user_id": "u1", "AND": [{"OR": [{"metadata.n": {"nin": list(range(100))}}] * 8}] * 3},
    }
    for name, filters in too_many.items():
        with subtests.test(name):
            started = time.perf_counter()
            response = client.post("/v1/memories/search", json=search_body(filters=filters))
            assert_error(response, 422, "filters", "invalid_input")
            assert "too many terms" in response.json()["error"]["message"]
            assert time.perf_counter() - started < 5  # refused before the work (not a timing target)


# -- batch -----------------------------------------------------------------------------------------
def test_batch_over_1000_items_is_422_and_stores_nothing(client):
    items = [add_body(text=f"note number {i}") for i in range(1001)]
    assert_error(client.post("/v1/memories/batch", json={"items": items}), 422, "items", "invalid_input")
    assert_nothing_stored(client)
    # One add of 1,001 messages makes as many memories: refused naming its own field (it named `items`).
    messages = [{"role": "user", "content": f"note number {i}"} for i in range(1001)]
    assert_error(client.post("/v1/memories", json={"messages": messages, "user_id": "u1"}), 422, "messages",
                 "invalid_input")
    assert_nothing_stored(client)


def test_batch_without_items_is_422(client):
    for body in ({}, {"items": []}, {"items": "I like tea"}, {"items": {"0": add_body()}}):
        assert_error(client.post("/v1/memories/batch", json=body), 422, "items", "invalid_input")
    assert_nothing_stored(client)


BAD_ITEMS = [
    ("empty text", add_body(text=""), "items[5].text"),
    ("whitespace-only text", add_body(text="   "), "items[5].text"),
    ("no scope id", add_body(user_id=None), "items[5].user_id"),
    ("expires_at in the past", add_body(expires_at=PAST), "items[5].expires_at"),
    ("both text and messages", add_body(messages=[USER_MESSAGE]), "items[5].messages"),
    ("only system messages", add_body(text=None, messages=[{"role": "system", "content": "x"}]), "items[5].messages"),
    ("text over 32 KiB", add_body(text="a" * (MAX_TEXT + 1)), "items[5].text"),
]


def test_batch_with_bad_item_5_stores_nothing(client, subtests):
    good = [add_body(text=f"I like tea number {i}") for i in range(5)]
    for name, bad, field in BAD_ITEMS:
        with subtests.test(name):
            items = [*good, bad, add_body(text="I like coffee too")]
            assert_error(client.post("/v1/memories/batch", json={"items": items}), 422, field, "invalid_input")
            assert_nothing_stored(client)


def test_batch_schema_error_names_the_item_like_other_item_errors(client):
    # Service checks name `items[5].text`; a schema error in the same item should use the same path style.
    good = [add_body(text=f"I like tea number {i}") for i in range(5)]
    for bad, field in ((add_body(user_id="a b"), "items[5].user_id"),
                       (add_body(text=None, messages=[{"role": "user"}]), "items[5].messages[0].content")):
        assert_error(client.post("/v1/memories/batch", json={"items": [*good, bad]}), 422, field, "invalid_input")
    assert_nothing_stored(client)


# -- search ----------------------------------------------------------------------------------------
def search_body(**fields) -> dict:
    body = {"query": "green tea", "user_id": "u1", **fields}
    return {k: v for k, v in body.items() if v is not None}


def filtered(filters) -> dict:
    return search_body(user_id=None, filters=filters)


SEARCH_CASES = [
    ("top_k not a number", search_body(top_k="ten"), "top_k"),
    ("top_k 0", search_body(top_k=0), "top_k"),
    ("top_k a string of digits", search_body(top_k="10"), "top_k"),
    ("top_k a boolean", search_body(top_k=True), "top_k"),
    ("top_k a fraction", search_body(top_k=2.5), "top_k"),
    ("threshold a boolean", search_body(threshold=False), "threshold"),
    ("top_k 101", search_body(top_k=101), "top_k"),
    ("threshold below 0", search_body(threshold=-0.1), "threshold"),
    ("threshold above 1", search_body(threshold=1.5), "threshold"),
    ("unknown mode", search_body(mode="fuzzy"), "mode"),
    ("user_id with a slash", search_body(user_id="x/y"), "user_id"),
    ("agent_id of 129 characters", search_body(agent_id="a" * 129), "agent_id"),
    ("no scope id at all", search_body(user_id=None), "filters"),
    ("only a metadata filter", filtered({"metadata.topic": "tea"}), "filters"),
    ("only a negated scope", filtered({"NOT": [{"user_id": "u1"}]}), "filters"),
    ("scope only on one side of OR", filtered({"OR": [{"user_id": "u1"}, {"metadata.topic": "tea"}]}), "filters"),
    ("filters a list", filtered([{"user_id": "u1"}]), "filters"),
    ("filters empty", search_body(filters={}), "filters"),
    ("AND not a list", filtered({"AND": {"user_id": "u1"}}), "filters.AND"),
    ("OR empty", filtered({"OR": []}), "filters.OR"),
    ("unknown field", filtered({"user_id": "u1", "colour": "red"}), "filters.colour"),
    ("tenant is not a filter field", filtered({"user_id": "u1", "tenant": "other"}), "filters.tenant"),
    ("unknown operator on metadata", filtered({"user_id": "u1", "metadata.topic": {"regex": "t.*"}}),
     "filters.metadata.topic.regex"),
    ("unknown operator on a scope id", filtered({"user_id": {"regex": "u.*"}}), "filters.user_id.regex"),
    ("unknown operator inside OR", filtered({"user_id": "u1", "OR": [{"metadata.a": 1}, {"metadata.b": {"like": 2}}]}),
     "filters.OR[1].metadata.b.like"),
    ("in with a non-list", filtered({"user_id": {"in": "u1"}}), "filters.user_id.in"),
    ("in with an empty list", filtered({"user_id": {"in": []}}), "filters.user_id.in"),
    ("range on a scope id", filtered({"user_id": {"gt": "u1"}}), "filters.user_id.gt"),
    ("bad scope id in filters", filtered({"user_id": "a b"}), "filters.user_id"),
    ("bad scope id inside OR", filtered({"OR": [{"user_id": "u1"}, {"agent_id": "x/y"}]}), "filters.OR[1].agent_id"),
    ("gt with a string on metadata", filtered({"user_id": "u1", "metadata": {"priority": {"gt": "high"}}}),
     "filters.metadata.priority.gt"),
    ("metadata in with mixed types", filtered({"user_id": "u1", "metadata.tag": {"in": ["a", 1]}}),
     "filters.metadata.tag.in"),
    ("metadata contains an empty string", filtered({"user_id": "u1", "metadata.tag": {"contains": ""}}),
     "filters.metadata.tag.contains"),
    ("bad metadata key", filtered({"user_id": "u1", "metadata.a b": 1}), "filters.metadata.a b"),
    ("bad ISO time on created_at", filtered({"user_id": "u1", "created_at": {"gt": "yesterday"}}),
     "filters.created_at.gt"),
    ("number for created_at", filtered({"user_id": "u1", "created_at": {"lt": 1700000000}}), "filters.created_at.lt"),
    ("in on created_at", filtered({"user_id": "u1", "created_at": {"in": [PAST]}}), "filters.created_at.in"),
]


def test_search_with_bad_body_is_422_naming_the_field(client, subtests):
    add(client)  # something a too-lenient search could return
    for name, body, field in SEARCH_CASES:
        with subtests.test(name):
            assert_error(client.post("/v1/memories/search", json=body), 422, field, "invalid_input")


def test_search_query_errors_name_the_query_field(client):
    # `query` is both a body field and a location name in FastAPI's error paths; the field must survive.
    for body, message in ((search_body(query=""), "at least 1 character"), (search_body(query=None), "required")):
        response = client.post("/v1/memories/search", json=body)
        assert_error(response, 422, "query", "invalid_input")
        assert message in response.json()["error"]["message"]
    long = client.post("/v1/memories/search", json=search_body(query="tea " * 1025))
    assert_error(long, 422, "query", "invalid_input")


def test_metadata_filter_with_out_of_range_integer_is_not_a_500(client):
    add(client)
    for operand, field in ((10 ** 30, "filters.metadata.n"), ({"in": [2 ** 63]}, "filters.metadata.n.in"),
                           ({"ne": -(2 ** 70)}, "filters.metadata.n.ne")):
        response = client.post("/v1/memories/search", json=filtered({"user_id": "u1", "metadata.n": operand}))
        if expect_status(response, 200, 422).status_code == 422:  # it may just match nothing; never a 500
            assert_error(response, 422, field)


# -- list and delete by scope ----------------------------------------------------------------------
LIST_CASES = [
    ("user_id with a space", {"user_id": "a b"}, "user_id"),
    ("user_id with a slash", {"user_id": "x/y"}, "user_id"),
    ("agent_id of 129 characters", {"agent_id": "a" * 129}, "agent_id"),
    ("empty run_id", {"run_id": ""}, "run_id"),
    ("limit 0", {"limit": 0}, "limit"),
    ("limit 201", {"limit": 201}, "limit"),
    ("limit not a number", {"limit": "ten"}, "limit"),
]


def test_list_with_bad_query_is_422_naming_the_field(client, subtests):
    for name, params, field in LIST_CASES:
        with subtests.test(name):
            assert_error(client.get("/v1/memories", params=params), 422, field, "invalid_input")


GARBAGE_CURSORS = ["!!!", "not-a-cursor", cursor_of([]), cursor_of({}), cursor_of(["yesterday", "x"]),
                   cursor_of([1, 2]), cursor_of("2024-01-01T00:00:00Z"), "A" * 512]


def test_bad_cursor_is_400(client, subtests):
    add(client)
    for cursor in GARBAGE_CURSORS:
        with subtests.test(cursor=cursor):
            assert_error(client.get("/v1/memories", params={"cursor": cursor}), 400, "cursor", "invalid_cursor")
    assert_error(client.get("/v1/memories", params={"cursor": "A" * 513}), 422, "cursor")


def test_forged_cursor_with_nul_byte_is_not_a_500(client):
    add(client)
    response = client.get("/v1/memories", params={"cursor": cursor_of(["2030-01-01T00:00:00+00:00", "x\x00"])})
    if expect_status(response, 200, 400).status_code == 400:
        assert_error(response, 400, "cursor", "invalid_cursor")


def test_forged_cursor_with_a_time_that_has_no_utc_value_is_400(client, subtests):
    """A reviewer's finding (session 27): the time passed the cursor's check, and failed as the
    query's parameter, in UTC (a 500)."""
    add(client)
    for moment in ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+05:00"):
        with subtests.test(moment):
            response = client.get("/v1/memories", params={"cursor": cursor_of([moment, str(uuid.uuid4())])})
            assert_error(response, 400, "cursor", "invalid_cursor")
    # A well-formed cursor of any time and id just lists from there (it can only reach the key's own memories).
    page = client.get("/v1/memories", params={"cursor": cursor_of(["9999-12-31T00:00:00-05:00", str(uuid.uuid4())])})
    assert len(expect_status(page, 200).json()["results"]) == 1


def test_delete_by_scope_with_bad_query_is_422_and_deletes_nothing(client):
    memory = add(client)
    assert_error(client.delete("/v1/memories"), 422, "user_id", "invalid_input")
    for params, field in (({"user_id": "a b"}, "user_id"), ({"agent_id": "x/y"}, "agent_id"),
                          ({"user_id": "u1", "run_id": "r" * 129}, "run_id"),
                          ([("user_id", "u2"), ("user_id", "u1")], "user_id"),  # which one? neither
                          ([("user_id", "u1"), ("run_id", "r1"), ("run_id", "r1")], "run_id")):
        assert_error(client.delete("/v1/memories", params=params), 422, field, "invalid_input")
    assert_error(client.get("/v1/memories", params=[("agent_id", "a1"), ("agent_id", "a2")]), 422, "agent_id")
    assert_unchanged(client, memory)


# -- update ----------------------------------------------------------------------------------------
PATCH_CASES = [
    ("empty body", {}, "text"),
    ("unknown field", {"colour": "red"}, "colour"),
    ("scope cannot be moved", {"text": "I like black tea", "user_id": "u2"}, "user_id"),
    ("empty text", {"text": ""}, "text"),
    ("whitespace-only text", {"text": "   "}, "text"),
    ("text over 32 KiB", {"text": "a" * (MAX_TEXT + 1)}, "text"),
    ("text not a string", {"text": ["I like tea"]}, "text"),
    ("metadata a list", {"metadata": ["tea"]}, "metadata"),
    ("expires_at in the past", {"expires_at": PAST}, "expires_at"),
    ("expires_at not a time", {"expires_at": "soon"}, "expires_at"),
    ("good text with a past expires_at", {"text": "I like black tea", "expires_at": PAST}, "expires_at"),
]


def test_patch_with_bad_body_is_422_and_changes_nothing(client, subtests):
    memory = add(client)
    path = f"/v1/memories/{memory['id']}"
    for name, body, field in PATCH_CASES:
        with subtests.test(name):
            assert_error(client.patch(path, json=body), 422, field, "invalid_input")
    assert_error(client.patch(path), 422, None, "invalid_input")
    assert_error(post_raw(client, path, b'{"text": ', method="PATCH"), 400, None, "malformed_json")
    assert_unchanged(client, memory)


# -- unknown ids -----------------------------------------------------------------------------------
UNKNOWN_IDS = [str(uuid.uuid4()), "garbage", "not a uuid", "x" * 300, "1' OR '1'='1", "%E2%98%83", "-1"]


def test_unknown_or_garbage_memory_id_is_404(client, subtests):
    memory = add(client)
    for memory_id in UNKNOWN_IDS:
        with subtests.test(memory_id=memory_id):
            path = f"/v1/memories/{memory_id}"
            assert_error(client.get(path), 404, None, "not_found")
            assert_error(client.patch(path, json={"text": "I like black tea"}), 404, None, "not_found")
            assert_error(client.delete(path), 404, None, "not_found")
            assert_error(client.get(f"{path}/history"), 404, None, "not_found")
    assert_unchanged(client, memory)
    long_id = "x" * 6000  # the message names the id, cut short: the whole path came back in every 404
    message = client.get(f"/v1/memories/{long_id}").json()["error"]["message"]
    assert message.startswith("no memory 'xxxx") and len(message) < 100


def test_memory_id_with_nul_byte_is_404_not_500(client):
    memory = add(client)
    for method, path in (("GET", "/v1/memories/%00"), ("DELETE", "/v1/memories/%00"),
                         ("GET", "/v1/memories/%00/history"), ("GET", f"/v1/memories/{memory['id']}%00")):
        assert_error(client.request(method, path), 404, None, "not_found")
    assert_unchanged(client, memory)


def test_deleted_memory_is_404_afterwards(client):
    memory = add(client)
    assert client.delete(f"/v1/memories/{memory['id']}").json() == {"deleted": 1}
    for method in ("GET", "DELETE"):
        assert_error(client.request(method, f"/v1/memories/{memory['id']}"), 404, None, "not_found")
    assert_error(client.patch(f"/v1/memories/{memory['id']}", json={"text": "back again"}), 404, None, "not_found")
    assert_nothing_stored(client)


def test_expired_memory_is_404(client):
    soon = (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()
    memory_id = client.post("/v1/memories", json=add_body(expires_at=soon)).json()["results"][0]["id"]
    deadline = datetime.now(timezone.utc) + timedelta(seconds=10)
    while client.get(f"/v1/memories/{memory_id}").status_code == 200:
        assert datetime.now(timezone.utc) < deadline, "the memory did not expire"
        time.sleep(0.1)
    assert_error(client.get(f"/v1/memories/{memory_id}"), 404, None, "not_found")
    assert_error(client.patch(f"/v1/memories/{memory_id}", json={"text": "renewed"}), 404, None, "not_found")


def test_wrong_method_is_405_and_allow_names_every_method_of_the_path(client, subtests):
    for method, path, allowed in (("PUT", "/v1/memories", "DELETE, GET, POST"),
                                  ("PUT", "/v1/memories/01a2", "DELETE, GET, PATCH"),
                                  ("POST", "/v1/memories/01a2/history", "GET"),
                                  ("GET", "/v1/admin/keys/key_1", "DELETE"),
                                  ("POST", "/healthz", "GET, HEAD"), ("DELETE", "/readyz", "GET, HEAD")):
        with subtests.test(f"{method} {path}"):
            response = client.request(method, path)
            assert_error(response, 405, None, "method_not_allowed")
            assert response.headers["allow"] == allowed


# -- bodies not sent as JSON, and times --------------------------------------------------------------
def test_a_json_body_sent_without_a_json_content_type_is_422_saying_so(client, subtests):
    """`curl -d '{...}'` without -H sends application/x-www-form-urlencoded; the body is then not read as
    JSON (FastAPI's rule). The answer says why, on every body route, the direct ones included."""
    memory = add(client)
    requests = [("POST", "/v1/memories", add_body(text="I like black tea")),
                ("POST", "/v1/memories/batch", {"items": [add_body(text="I like black tea")]}),
                ("POST", "/v1/memories/search", search_body()),
                ("PATCH", f"/v1/memories/{memory['id']}", {"text": "I like black tea"})]
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        for method, path, body in requests:
            with subtests.test(content_type=content_type, path=path):
                headers = {"Content-Type": content_type} if content_type else {}
                response = client.request(method, path, content=json.dumps(body).encode(), headers=headers)
                assert response.request.headers.get("content-type") == content_type
                assert_error(response, 422, None, "invalid_input")
                assert "Content-Type: application/json" in response.json()["error"]["message"]
    assert_unchanged(client, memory)
    assert [m["id"] for m in client.get("/v1/memories").json()["results"]] == [memory["id"]]


# Numbers were read as Unix seconds ("20991231" as 1970-08-31, so "in the past"), while a filter read
# the same string as a date: a time is an ISO 8601 string, in bodies and filters alike.
NOT_TIMES = [4102444800, 4102444800.5, "4102444800", "20991231", "20991231T000000Z", "2099-W52-4", True,
             "2099-12-31T00:00:00+05", "31/12/2099", ""]


def test_expires_at_that_is_a_number_or_not_iso_8601_is_422_naming_it(client, subtests):
    memory = add(client)
    for value in NOT_TIMES:
        with subtests.test(value=value):
            response = client.post("/v1/memories", json=add_body(text="I like black tea", expires_at=value))
            assert_error(response, 422, "expires_at", "invalid_input")
            assert "ISO 8601" in response.json()["error"]["message"]
            batch = {"items": [add_body(text="I like coffee"), add_body(text="I like black tea", expires_at=value)]}
            assert_error(client.post("/v1/memories/batch", json=batch), 422, "items[1].expires_at", "invalid_input")
            assert_error(client.patch(f"/v1/memories/{memory['id']}", json={"expires_at": value}), 422, "expires_at")
            found = client.post("/v1/memories/search", json=filtered({"user_id": "u1", "created_at": {"lt": value}}))
            assert_error(found, 422, "filters.created_at.lt", "invalid_input")
    assert_unchanged(client, memory)
    assert [m["id"] for m in client.get("/v1/memories").json()["results"]] == [memory["id"]]


def test_a_time_means_the_same_in_expires_at_and_in_filters(client):
    """A date alone is midnight UTC, no zone is UTC, and an offset is converted, in a body and in a filter."""
    spellings = {"2099-12-31": "2099-12-31T00:00:00Z", "2099-12-31T10:30:00": "2099-12-31T10:30:00Z",
                 "2099-12-31t10:30:00+05:30": "2099-12-31T05:00:00Z", "2099-12-31 23:45z": "2099-12-31T23:45:00Z"}
    for n, (spelling, utc) in enumerate(spellings.items()):
        added = client.post("/v1/memories", json=add_body(text=f"I like tea number {n}", expires_at=spelling))
        memory_id = expect_status(added, 200).json()["results"][0]["id"]
        assert client.get(f"/v1/memories/{memory_id}").json()["expires_at"] == utc
        for filter_value in (spelling, utc):
            found = client.post("/v1/memories/search", json=filtered({"user_id": "u1", "expires_at": filter_value}))
            assert [hit["id"] for hit in expect_status(found, 200).json()["results"]] == [memory_id], filter_value
