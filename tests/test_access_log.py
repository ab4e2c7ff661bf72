"""The access log: a line for each request, written by the app (memory_server/access_log.py)."""

import asyncio
import io
import re
import socket

import pytest

from conftest import make_settings, start_server, wait_for
from memory_server.access_log import FLUSH_SECONDS, PIPE_BUF, AccessLog

LINE = re.compile(r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO memory_server\.access: (\S+) - "(.*)" (\d{3}) (\d+\.\d)ms$')


def _lines(stream: io.StringIO) -> list[tuple[str, str, int, float]]:
    """(client, request line, status, milliseconds) of each line written, checked against the format."""
    found = []
    for line in stream.getvalue().splitlines():
        match = LINE.match(line)
        assert match, line
        found.append((match[1], match[2], int(match[3]), float(match[4])))
    return found


@pytest.fixture
def logged(tmp_path, embedder):
    """A running server whose access log is written into a StringIO."""
    live, stop = start_server(make_settings(tmp_path, access_log=True), embedder)
    stream = live.app.state.access_log.stream = io.StringIO()
    yield live, stream
    stop()


def test_every_request_has_a_line_with_client_target_status_and_duration(logged):
    live, stream = logged
    with live.client() as c:
        assert c.post("/v1/memories", json={"text": "Alice keeps bees", "user_id": "alice"}).status_code == 200
        assert c.post("/v1/memories/search", json={"query": "bees", "user_id": "alice"}).status_code == 200
        assert c.get("/v1/memories", params={"user_id": "alice", "page_size": 5}).status_code == 200
        assert c.get("/v1/memories/not-a-memory").status_code == 404
    with live.client("msk_wrong") as c:
        assert c.post("/v1/memories/search", json={"query": "bees", "user_id": "alice"}).status_code == 401
    assert wait_for(lambda: len(stream.getvalue().splitlines()) == 5, "the lines to be written", timeout=5)
    lines = _lines(stream)
    assert [(request, status) for _, request, status, _ in lines] == [
        ("POST /v1/memories HTTP/1.1", 200),
        ("POST /v1/memories/search HTTP/1.1", 200),
        ("GET /v1/memories?user_id=alice&page_size=5 HTTP/1.1", 200),
        ("GET /v1/memories/not-a-memory HTTP/1.1", 404),
        ("POST /v1/memories/search HTTP/1.1", 401),
    ]
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", client) for client, _, _, _ in lines)
    assert lines[0][3] > 1.0  # an add embeds its text: more than a millisecond
    assert all(ms < 60_000 for _, _, _, ms in lines)


def test_a_target_is_logged_as_sent_so_an_encoded_line_break_stays_encoded(logged):
    live, stream = logged
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:  # as sent: no client to normalize it
        raw.sendall(b"GET /v1/memories/a%0Ab%22?x=%0D%0AINFO HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    assert wait_for(lambda: stream.getvalue().endswith("\n"), "the line to be written", timeout=5)
    [(_, request, status, _)] = _lines(stream)
    assert (request, status) == ("GET /v1/memories/a%0Ab%22?x=%0D%0AINFO HTTP/1.1", 401)


def test_bytes_of_no_printable_character_are_percent_encoded():
    """uvicorn's parser refuses them; another ASGI server, or a test client, may not."""
    stream = io.StringIO()

    async def serve():
        log = AccessLog(stream)
        log.request({"method": "GET", "path": "/v1/\xff\n", "raw_path": b"/v1/\xff\n", "query_string": b"q=\x85",
                     "client": None}, 404, 0.001)
        log.request({"method": "GET", "path": "/v1/caf\u00e9\r"}, 404, 0.001)  # no raw_path: the path, encoded
        log.request({"method": "GET", "path": "/v1/x", "raw_path": b"/v1/caf\xe9"}, 404, 0.001)  # printable, not ASCII
        log.flush()

    asyncio.run(serve())
    assert [(client, request) for client, request, _, _ in _lines(stream)] == [
        ("-", "GET /v1/%FF%0A?q=%85 HTTP/1.1"), ("-", "GET /v1/caf%C3%A9%0D HTTP/1.1"), ("-", "GET /v1/caf%E9 HTTP/1.1")]


def test_lines_are_written_together_in_pieces_a_pipe_takes_whole():
    writes = []

    class Recorded(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    scope = {"type": "http", "method": "POST", "path": "/v1/memories/search", "raw_path": b"/v1/memories/search",
             "query_string": b"", "http_version": "1.1", "client": ("10.0.0.7", 51234)}

    async def serve():
        log = AccessLog(Recorded())
        for _ in range(3):
            log.request(scope, 200, 0.0034)
        assert writes == []  # not yet: together, once the first waited FLUSH_SECONDS
        await asyncio.sleep(FLUSH_SECONDS * 2)
        assert len(writes) == 1 and writes[0].count("\n") == 3
        assert writes[0].splitlines()[0].endswith(' INFO memory_server.access: 10.0.0.7:51234 - '
                                                  '"POST /v1/memories/search HTTP/1.1" 200 3.4ms')
        writes.clear()
        for _ in range(200):  # ~100 bytes a line: more than a pipe's atomic write in all
            log.request(scope, 200, 0.0034)
        log.flush()
        assert len(writes) > 1 and all(len(text) <= PIPE_BUF and text.endswith("\n") for text in writes)
        assert sum(text.count("\n") for text in writes) == 200

    asyncio.run(serve())


def test_the_access_log_follows_the_log_level_and_its_setting(tmp_path, embedder):
    from memory_server.app import create_app

    from memory_server.config import Settings

    assert Settings(data_dir=tmp_path / "a").access_log  # on by default
    assert create_app(make_settings(tmp_path / "a", access_log=True)).state.access_log is not None
    assert create_app(make_settings(tmp_path / "b", access_log=True, log_level="WARNING")).state.access_log is None
    assert create_app(make_settings(tmp_path / "c", access_log=False)).state.access_log is None
