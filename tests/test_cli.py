"""The memory-server command, run as a user would: serve, keys, reindex."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import make_settings, wait_for
from memory_server.auth import Principal
from memory_server.errors import StartupError
from memory_server.runtime import Runtime
from memory_server.schemas import AddRequest, SearchRequest

CLI = [sys.executable, "-m", "memory_server"]


def run_cli(*args, data_dir: Path, check=True, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    result = subprocess.run([*CLI, *args, "--data-dir", str(data_dir)], capture_output=True, text=True, env=env,
                            timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(tmp_path, *extra):
    """A real `memory-server serve` process on a free port: (url, data dir, log path)."""
    data_dir, port = tmp_path / "data", free_port()
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen([*CLI, "serve", "--port", str(port), "--data-dir", str(data_dir), *extra],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        time.sleep(0.3)
    try:
        yield url, data_dir, tmp_path / "serve.log"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture
def served(tmp_path):
    with serving(tmp_path) as running:
        yield running


def test_serve_writes_bootstrap_key_0600_and_logs_only_its_path(served):
    url, data_dir, log_path = served
    key_file = data_dir / "bootstrap-admin.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    log = log_path.read_text()
    assert str(key_file) in log and key not in log
    assert f"data directory {data_dir.resolve()}" in log  # a mistyped --data-dir shows as a new, empty store
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{url}/v1/memories", params={"user_id": "x"}).status_code == 401
    assert httpx.get(f"{url}/v1/memories", params={"user_id": "x"}, headers={"Authorization": f"Token {key}"}).status_code == 200


def test_walkthrough_cli_agent_key_add_search(served):
    url, data_dir, log_path = served
    created = run_cli("keys", "create", "--tenant", "default", "--role", "agent", "--user-id", "alice", data_dir=data_dir)
    agent_key = created.stdout.strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {agent_key}"}
    response = httpx.post(f"{url}/v1/memories", headers=headers, json={"text": "Alice likes green tea"})
    assert response.status_code == 200, (response.status_code, response.text, created.stdout)
    assert response.json()["results"][0]["event"] == "ADD"
    response = httpx.post(f"{url}/v1/memories/search", headers=headers, json={"query": "what does alice drink"})
    assert response.status_code == 200, (response.status_code, response.text)
    found = response.json()
    assert found["results"][0]["memory"] == "Alice likes green tea" and found["results"][0]["user_id"] == "alice"
    # The access log, on by default; its lines are written together within a fraction of a second.
    assert wait_for(lambda: '"POST /v1/memories/search HTTP/1.1" 200' in log_path.read_text(), "the access log line",
                    timeout=10)


def test_serve_can_leave_out_the_access_log(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMORY_SERVER_ACCESS_LOG", "false")
    with serving(tmp_path) as (url, _, log_path):
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert httpx.get(f"{url}/v1/memories/nope").status_code == 401
        log = log_path.read_text()
    assert "Application startup complete" in log and "GET /healthz" not in log and "/v1/memories" not in log


def test_keys_create_list_revoke(tmp_path):
    data_dir = tmp_path / "data"
    created = run_cli("keys", "create", "--tenant", "acme", "--role", "agent", "--user-id", "u1", "--agent-id", "bot",
                      data_dir=data_dir)
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("msk_") and " " not in key
    key_id = created.stdout.split()[1]
    listing = run_cli("keys", "list", data_dir=data_dir).stdout
    assert key_id in listing and "acme" in listing and key not in listing
    run_cli("keys", "revoke", key_id, data_dir=data_dir)

    from sqlmodel import Session

    from memory_server.auth import verify_key
    from memory_server.errors import Unauthorized
    from memory_server.storage.db import make_engine

    engine = make_engine(f"sqlite:///{data_dir / 'memory.db'}")
    with Session(engine) as session, pytest.raises(Unauthorized):
        verify_key(session, key)
    engine.dispose()


def test_keys_create_rejects_bad_role_and_tenant(tmp_path):
    bad_role = run_cli("keys", "create", "--tenant", "acme", "--role", "root", data_dir=tmp_path, check=False)
    assert bad_role.returncode != 0 and "role" in bad_role.stderr
    bad_tenant = run_cli("keys", "create", "--tenant", "a b", "--role", "agent", data_dir=tmp_path, check=False)
    assert bad_tenant.returncode != 0 and "tenant" in bad_tenant.stderr
    assert run_cli("keys", "revoke", "key_missing", data_dir=tmp_path, check=False).returncode != 0


def _refused(result: subprocess.CompletedProcess, *names: str) -> str:
    """The one `error: …` line of a command refused with exit status 2 (no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, (result.returncode, result.stderr[-3000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and all(name in errors[0] for name in names), result.stderr
    return errors[0]


@pytest.mark.parametrize("args", [("serve", "--port", "99999"), ("serve", "--port", "0"), ("serve", "--workers", "0"),
                                  ("serve", "--workers", "65")])
def test_an_out_of_range_option_is_refused_naming_it(tmp_path, args):
    _refused(run_cli(*args, data_dir=tmp_path / "data", check=False), args[1])
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("variable, value", [("MEMORY_SERVER_DEDUP_THRESHOLD", "2"), ("MEMORY_SERVER_PORT", "http"),
                                             ("MEMORY_SERVER_WARM_DATABASE", "maybe"),
                                             ("MEMORY_SERVER_EMBEDDING_BACKEND", "gpu"),
                                             ("MEMORY_SERVER_LOG_LEVEL", "LOUD"),
                                             ("MEMORY_SERVER_DATABASE_URL", "not a url"),
                                             ("MEMORY_SERVER_DATABASE_URL", "nosuchdb://host/db")])
def test_a_bad_environment_setting_is_refused_naming_it(tmp_path, variable, value):
    for command in (("keys", "list"), ("reindex",)):
        _refused(run_cli(*command, data_dir=tmp_path / "data", check=False, env={variable: value}), variable)


def test_a_database_url_with_a_password_is_never_echoed_when_refused(tmp_path):
    result = run_cli("keys", "list", data_dir=tmp_path, check=False,
                     env={"MEMORY_SERVER_DATABASE_URL": "nosuchdb://memory:s3cret@db/memory"})
    assert "s3cret" not in _refused(result, "MEMORY_SERVER_DATABASE_URL")


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("not a data directory")
    for command in (("keys", "list"), ("reindex",), ("serve", "--port", str(free_port()))):
        _refused(run_cli(*command, data_dir=a_file, check=False), "--data-dir", "not a directory")
    under_a_file = run_cli("keys", "list", data_dir=a_file / "data", check=False)
    _refused(under_a_file, str(a_file / "data"))
    assert a_file.read_text() == "not a data directory"


def test_a_new_data_dir_is_named_when_created(tmp_path):
    result = run_cli("keys", "list", data_dir=tmp_path / "typo")
    assert f"created a new, empty data directory {(tmp_path / 'typo').resolve()}" in result.stderr
    assert "created" not in run_cli("keys", "list", data_dir=tmp_path / "typo").stderr


@pytest.mark.parametrize("label", ["two\tcolumns", "two\nlines", "a\rreturn", "bell\x07", "x" * 201])
def test_keys_create_refuses_a_label_the_http_api_or_keys_list_cannot_take(tmp_path, label):
    _refused(run_cli("keys", "create", "--tenant", "acme", "--label", label, data_dir=tmp_path, check=False), "label")
    assert run_cli("keys", "list", data_dir=tmp_path).stdout.count("\n") == 1  # the header: nothing was created


@pytest.mark.parametrize("option, value", [("--tenant", "default\n"), ("--user-id", "bob\n"), ("--agent-id", "bot\n")])
def test_keys_create_refuses_an_id_ending_in_a_newline(tmp_path, option, value):
    """The id check's pattern ended in `$`, which also matches before a final newline: `--user-id
    $'bob\\n'` made a key `keys list` split over two lines, and `--tenant $'default\\n'` an admin of a
    tenant that looks like `default` (a fuzzing review, session 28). The HTTP API refused them."""
    args = ["--tenant", "acme", "--role", "agent", option, value] if option != "--tenant" else [option, value]
    _refused(run_cli("keys", "create", *args, data_dir=tmp_path, check=False), option.removeprefix("--").split("-")[0])
    assert run_cli("keys", "list", data_dir=tmp_path).stdout.count("\n") == 1  # the header: nothing was created


def test_keys_create_takes_a_label_of_200_characters(tmp_path):
    label = "Café ops — " + "x" * 189
    run_cli("keys", "create", "--tenant", "acme", "--label", label, data_dir=tmp_path)
    rows = run_cli("keys", "list", data_dir=tmp_path).stdout.splitlines()
    assert rows[1].split("\t")[5] == label


def test_keys_list_keeps_one_line_per_key_whatever_its_label(tmp_path):
    # A label stored before labels were checked (or written into the database) must not break the rows.
    from sqlmodel import Session

    from memory_server.auth import create_key
    from memory_server.storage.db import create_schema, make_engine

    engine = make_engine(f"sqlite:///{tmp_path / 'memory.db'}")
    create_schema(engine)
    with Session(engine) as session:
        create_key(session, tenant_id="acme", role="agent", label="two\tcols\nand a line")
    engine.dispose()
    rows = run_cli("keys", "list", data_dir=tmp_path).stdout.splitlines()
    assert len(rows) == 2 and [len(row.split("\t")) for row in rows] == [8, 8]
    assert rows[1].split("\t")[5] == "two\\tcols\\nand a line"


UMA = Principal("t", "k", "admin")


def _two_memories(settings, embedder, *, other_process: bool = False) -> None:
    """Uma's two memories stored; with `other_process`, a second server process's index (index-1) too."""
    rt = Runtime.open(settings, embedder=embedder)
    other = Runtime.open(settings, embedder=embedder) if other_process else None
    rt.memories.add_batch(UMA, [AddRequest(text=t, user_id="u") for t in ("Uma sails", "Uma paints murals")])
    if other:
        other.close()
    rt.close()


def _assert_reindexed(settings, embedder) -> subprocess.CompletedProcess:
    result = run_cli("reindex", data_dir=settings.data_dir)
    assert "reindexed 2 memories" in result.stderr + result.stdout
    rt = Runtime.open(settings, embedder=embedder)
    try:
        hits = rt.memories.search(UMA, SearchRequest(query="murals", filters={"user_id": "u"}, mode="keyword"))
        assert [h.memory for h in hits] == ["Uma paints murals"]
    finally:
        rt.close()
    return result


def test_reindex_command_rebuilds_from_sql(tmp_path, embedder):
    settings = make_settings(tmp_path / "data")
    _two_memories(settings, embedder, other_process=True)
    shutil.rmtree(settings.data_dir / "index")  # lose the index entirely
    result = _assert_reindexed(settings, embedder)
    assert "removed index-1" in result.stderr + result.stdout and not (settings.data_dir / "index-1").exists()


def test_reindex_refuses_while_a_server_holds_the_index_and_leaves_it_alone(served):
    url, data_dir, _ = served
    key = (data_dir / "bootstrap-admin.key").read_text().strip()
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{url}/v1/memories", headers=headers, json={"text": "Vera sails", "user_id": "v"}).status_code == 200
    before = sorted(p.name for p in data_dir.iterdir())
    _refused(run_cli("reindex", data_dir=data_dir, check=False), "index", "stop")
    assert sorted(p.name for p in data_dir.iterdir()) == before and not (data_dir / "index-1").exists()
    found = httpx.post(f"{url}/v1/memories/search", headers=headers,
                       json={"query": "sails", "filters": {"user_id": "v"}, "mode": "keyword"}).json()
    assert [hit["memory"] for hit in found["results"]] == ["Vera sails"]


def test_reindex_refuses_while_another_process_holds_a_further_index(tmp_path, embedder):
    # The server left running on index-1 would go on answering from its old index.
    from memory_server.storage.vectors.edge import claim_shard_dir

    settings = make_settings(tmp_path / "data")
    _two_memories(settings, embedder, other_process=True)
    first, first_hold = claim_shard_dir(settings.data_dir)
    second, second_hold = claim_shard_dir(settings.data_dir)
    first_hold.close()  # index/ is free, index-1/ is held (as by a second `serve` started later)
    try:
        assert (first.name, second.name) == ("index", "index-1")
        _refused(run_cli("reindex", data_dir=settings.data_dir, check=False), "index-1", "stop")
        assert not (settings.data_dir / "index-2").exists()
    finally:
        second_hold.close()
    _assert_reindexed(settings, embedder)


def test_a_damaged_index_is_refused_with_the_way_out_and_reindex_rebuilds_it(tmp_path, embedder):
    settings = make_settings(tmp_path / "data")
    _two_memories(settings, embedder)
    for path in (settings.data_dir / "index").rglob("*"):  # every file cut short, as by a full disk
        if path.is_file() and path.stat().st_size:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(StartupError, match=r"cannot be read .*derived from the database: `memory-server reindex`"):
        Runtime.open(settings, embedder=embedder)
    _assert_reindexed(settings, embedder)


def test_key_revoked_outside_the_server_is_refused_within_the_cache_ttl(tmp_path, embedder):
    from sqlmodel import Session

    from conftest import start_server
    from memory_server.auth import create_key, revoke_key

    live, stop = start_server(make_settings(tmp_path / "data", key_cache_seconds=0.5), embedder)
    try:
        engine = live.app.state.runtime.engine
        with Session(engine) as session:
            row, key = create_key(session, tenant_id="default", role="agent")
        with live.client(key) as c:
            assert c.get("/v1/memories", params={"user_id": "u"}).status_code == 200
            with Session(engine) as session:  # as `memory-server keys revoke` or another replica would
                revoke_key(session, row.id)
            time.sleep(0.6)
            assert c.get("/v1/memories", params={"user_id": "u"}).status_code == 401
    finally:
        stop()


def test_serve_with_workers_answers_every_write_from_whichever_process(tmp_path):
    with serving(tmp_path, "--workers", "2") as (url, data_dir, log_path):
        key = (data_dir / "bootstrap-admin.key").read_text().strip()
        headers = {"Authorization": f"Bearer {key}"}
        deadline = time.time() + 60  # the second worker may still be starting
        while not (data_dir / "index-1").exists() and time.time() < deadline:
            time.sleep(0.2)
        assert (data_dir / "index").is_dir() and (data_dir / "index-1").is_dir(), log_path.read_text()
        for i in range(12):
            # A new connection each time: the kernel hands it to either worker.
            added = httpx.post(f"{url}/v1/memories", headers=headers,
                               json={"text": f"Pat's locker number is {100 + i}", "user_id": "pat"}).json()
            found = httpx.post(f"{url}/v1/memories/search", headers=headers,
                               json={"query": f"locker {100 + i}", "filters": {"user_id": "pat"}, "top_k": 3}).json()
            assert added["results"][0]["id"] in [hit["id"] for hit in found["results"]]
        listed = httpx.get(f"{url}/v1/memories", headers=headers, params={"user_id": "pat"}).json()
        assert len(listed["results"]) == 12
    keys = run_cli("keys", "list", data_dir=data_dir).stdout.strip().splitlines()
    assert len(keys) == 2  # header + one bootstrap key, though two workers started
    assert log_path.read_text().count("created the bootstrap admin key") == 1


def _server_sockets(port: int) -> list[tuple[int, str, int]]:
    """(pid, "listening" or "established", the client's port) for each server-side TCP socket on
    `port` (Linux /proc), to see which process holds which connection."""
    states = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("0A", "01"):
                states[fields[9]] = ("listening" if fields[3] == "0A" else "established",
                                     int(fields[2].rsplit(":", 1)[1], 16))
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
        except OSError:
            continue
        found += [(int(fd_dir.parent.name), *states[link[len("socket:["):-1]]) for link in links
                  if link.startswith("socket:[") and link[len("socket:["):-1] in states]
    return found


def _open_connections(url: str, count: int) -> list[socket.socket]:
    """`count` keep-alive connections opened at once, as a client pool does, each answered once."""
    host, port = url.rsplit("//", 1)[1].split(":")
    connections = [socket.create_connection((host, int(port))) for _ in range(count)]
    for c in connections:
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    for c in connections:
        assert c.recv(4096).startswith(b"HTTP/1.1 200")
    return connections


def _client_ports(port: int) -> dict[int, set[int]]:
    """{pid: the ports of the clients whose connections it holds}."""
    held: dict[int, set[int]] = {}
    for pid, state, client_port in _server_sockets(port):
        if state == "established":
            held.setdefault(pid, set()).add(client_port)
    return held


def _workers(port: int, count: int, timeout: float = 90) -> tuple[int, list[int]]:
    """(supervisor pid, worker pids): the process listening on `port`, and its worker processes
    once `count` of them run."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        listening = [pid for pid, state, _ in _server_sockets(port) if state == "listening"]
        if len(listening) == 1:
            workers = []
            for proc_stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    parent = proc_stat.read_text().rsplit(")", 1)[1].split()[1]
                    command = (proc_stat.parent / "cmdline").read_bytes()
                except OSError:
                    continue
                if parent == str(listening[0]) and b"spawn_main" in command:
                    workers.append(int(proc_stat.parent.name))
            if len(workers) == count:
                return listening[0], sorted(workers)
        time.sleep(0.3)
    raise AssertionError(f"not {count} workers behind port {port}: {_server_sockets(port)}")


@pytest.mark.skipif(not hasattr(socket, "send_fds"), reason="connection hand-off needs Unix descriptor passing")
def test_serve_with_workers_hands_each_connection_to_the_worker_holding_fewest(tmp_path):
    # uvicorn's shared socket let one worker take a whole pool of connections opened at once (16/0
    # in the HTTP benchmark), and a socket per worker (SO_REUSEPORT) split 64 by a hash, 43/21 at
    # worst. The supervisor accepts and hands each connection to the worker with the fewest open.
    with serving(tmp_path, "--workers", "2") as (url, _, log_path):
        port = int(url.rsplit(":", 1)[1])
        supervisor, (first, second) = _workers(port, 2)
        wait_for(lambda: log_path.read_text().count("Application startup complete") == 2, "both workers")
        connections = _open_connections(url, 24)
        try:
            held = _client_ports(port)
            assert len(held.get(first, ())) == 12 and len(held.get(second, ())) == 12, held
            assert supervisor not in held  # it only listens
            # The first worker's clients leave: the next connections all go to it.
            for c in connections:
                if c.getsockname()[1] in held[first]:
                    c.close()
            wait_for(lambda: not _client_ports(port).get(first), "the first worker to close its connections")
            time.sleep(0.5)  # its word on each closed connection reaches the supervisor
            connections += _open_connections(url, 12)
            held = _client_ports(port)
            assert len(held.get(first, ())) == 12 and len(held.get(second, ())) == 12, held
        finally:
            for c in connections:
                c.close()


def _policies(pid: int) -> dict[str, int]:
    """The scheduling policy of each thread of process `pid`, by its name."""
    policies = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            policies[f"{(task / 'comm').read_text().strip()} ({task.name})"] = os.sched_getscheduler(int(task.name))
        except OSError:  # a thread that ended meanwhile
            pass
    return policies


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("workers, setting", [("1", None), ("2", None), ("2", "false")])
def test_serve_runs_every_thread_of_every_process_under_sched_batch_unless_told_not_to(tmp_path, monkeypatch, workers,
                                                                                        setting):
    if setting is not None:
        monkeypatch.setenv("MEMORY_SERVER_BATCH_SCHEDULING", setting)
    with serving(tmp_path, "--workers", workers) as (url, data_dir, log_path):
        port = int(url.rsplit(":", 1)[1])
        if workers == "2":
            supervisor, serving_pids = _workers(port, 2)
        else:
            supervisor, serving_pids = None, [pid for pid, state, _ in _server_sockets(port) if state == "listening"]
        wait_for(lambda: log_path.read_text().count("Application startup complete") == int(workers), "the workers")
        headers = {"Authorization": f"Token {(data_dir / 'bootstrap-admin.key').read_text().strip()}"}
        # Two kept-alive connections, one to each worker: each worker's request threads start.
        with httpx.Client(base_url=url, headers=headers) as first, httpx.Client(base_url=url, headers=headers) as second:
            for n, client in enumerate([first, second] * 3):
                added = client.post("/v1/memories", json={"text": f"note {n}", "user_id": "u"})
                assert added.status_code == 200, added.text
                found = client.post("/v1/memories/search", json={"query": "note", "filters": {"user_id": "u"}})
                assert found.status_code == 200, found.text
        expected = os.SCHED_OTHER if setting == "false" else os.SCHED_BATCH
        for pid in serving_pids:
            policies = _policies(pid)
            assert any(name.startswith("embedding") for name in policies), policies  # the model's threads
            assert any(name.startswith("request") for name in policies), policies
            assert set(policies.values()) == {expected}, policies
        if supervisor is not None:
            assert set(_policies(supervisor).values()) == {expected}


@pytest.mark.skipif(not hasattr(socket, "send_fds"), reason="connection hand-off needs Unix descriptor passing")
def test_serve_with_workers_replaces_a_worker_that_dies_and_stops_them_all(tmp_path):
    import signal

    data_dir, port = tmp_path / "data", free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen([*CLI, "serve", "--port", str(port), "--data-dir", str(data_dir), "--workers", "2"],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        _, workers = _workers(port, 2)
        started = lambda: (tmp_path / "serve.log").read_text().count("Application startup complete")  # noqa: E731
        wait_for(lambda: started() == 2, "both workers to start")
        os.kill(workers[0], signal.SIGKILL)
        wait_for(lambda: workers[0] not in _workers(port, 2)[1], "a new worker")
        _, replaced = _workers(port, 2)
        assert workers[1] in replaced
        wait_for(lambda: started() == 3, "the new worker to start")
        for _ in range(6):  # new connections, some of them handed to the new worker
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30).status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in replaced)
        assert "exited with code -9; starting another" in (tmp_path / "serve.log").read_text()
    finally:
        if server.poll() is None:
            server.kill()
        log.close()


@pytest.mark.skipif(not hasattr(socket, "send_fds"), reason="connection hand-off needs Unix descriptor passing")
def test_serve_with_workers_gives_up_when_workers_keep_failing_at_start(tmp_path):
    # The workers open the index themselves; an unreachable Qdrant server fails every start. The
    # supervisor stops after three quick exits in a row instead of restarting them forever.
    result = subprocess.run([*CLI, "serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "data"),
                             "--workers", "2"], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "MEMORY_SERVER_QDRANT_URL": "http://127.0.0.1:9"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "workers keep exiting as they start" in result.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_port_in_use_before_loading_anything(tmp_path, workers):
    # One worker used to load the model and the index first and then fail in uvicorn (exit status 3).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*CLI, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                                 "--workers", workers], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert not (tmp_path / "data" / "index").exists()  # nothing was opened


def test_serve_with_workers_prepares_the_model_once_before_starting_them(tmp_path, monkeypatch):
    # A worker busy making the model files misses uvicorn's liveness pings and is restarted
    # mid-request; `serve --workers N` makes them first. The fp32 export is copied from the test
    # cache (exporting takes torch ~20 s); the int8 copy has to be made here.
    from conftest import MODEL_DIR

    models = tmp_path / "models"
    models.mkdir()
    for made in MODEL_DIR.glob("*"):
        if made.suffix in (".onnx", ".meta") and "-int8" not in made.name:
            shutil.copy(made, models / made.name)
    monkeypatch.setenv("MEMORY_SERVER_MODEL_DIR", str(models))
    with serving(tmp_path, "--workers", "2") as (url, data_dir, log_path):
        key = (data_dir / "bootstrap-admin.key").read_text().strip()
        for i in range(6):
            response = httpx.post(f"{url}/v1/memories", headers={"Authorization": f"Bearer {key}"},
                                  json={"text": f"Ravi parks in bay {i}", "user_id": "ravi"})
            assert response.status_code == 200, response.text
        log = log_path.read_text()
    assert len(list(models.glob("*-int8-per-token-w7-sym.onnx"))) == 1 and not list(models.glob("*.tmp"))
    assert "died" not in log and log.count("Started server process") == 2, log


def _read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 10 s pass)."""
    sock.settimeout(10)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return received


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_bounds_each_request_head_in_size_and_time(tmp_path, monkeypatch, workers):
    """uvicorn kept every byte of an unfinished head (512 MiB of headers grew a server by 550 MiB) and
    held connections that sent nothing, or a head a byte at a time, for good (session 27's review)."""
    monkeypatch.setenv("MEMORY_SERVER_REQUEST_HEAD_TIMEOUT_SECONDS", "1")
    with serving(tmp_path, "--workers", workers) as (url, data_dir, log_path):
        host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
        with socket.create_connection((host, port)) as huge:
            huge.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(64):  # 1 MiB of headers, never ended
                    huge.sendall(b"X-Filler: " + b"a" * 16_000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed meanwhile
            answer = _read_response(huge)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b'"code": "request_header_fields_too_large"' in answer
        with socket.create_connection((host, port)) as slow, socket.create_connection((host, port)) as silent:
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # and no more
            started = time.monotonic()
            assert _read_response(slow).startswith(b"HTTP/1.1 408 ")
            assert _read_response(silent) == b""  # closed without a word
            assert time.monotonic() - started < 8
        # A normal request on a kept-alive connection is not hurried by the head's timer.
        with httpx.Client(base_url=url) as client:
            assert client.get("/healthz").status_code == 200
            time.sleep(1.5)
            assert client.get("/healthz").status_code == 200


def test_a_slow_response_is_not_cut_off_by_the_head_timer_of_the_request_behind_it(tmp_path, monkeypatch):
    """A head that began arriving while a batch add was being answered got a 408 at the head timeout,
    and the batch's own 200 never came (a review of session 27's change): it is now timed from the
    moment the response is out."""
    monkeypatch.setenv("MEMORY_SERVER_REQUEST_HEAD_TIMEOUT_SECONDS", "0.3")
    with serving(tmp_path) as (url, data_dir, log_path):
        key = (data_dir / "bootstrap-admin.key").read_text().strip()
        items = [{"text": f"Ola's note number {i} about the harbour", "user_id": "ola"} for i in range(600)]
        body = json.dumps({"items": items}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(b"POST /v1/memories/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            time.sleep(0.1)  # the batch is being embedded (600 texts: well over 0.3 s)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # and no more
            answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b"HTTP/1.1 408 " in answer  # then the stalled head, timed from the batch's answer


def test_serve_stops_on_sigterm_even_with_a_client_stalled_mid_body(tmp_path):
    """One process waited for such a client for good; requests in hand now get 30 s."""
    import signal

    with serving(tmp_path) as (url, data_dir, log_path):
        port = int(url.rsplit(":", 1)[1])
        process = next(p for p in _serve_processes() if f"--port {port}" in p[1])
        key = (data_dir / "bootstrap-admin.key").read_text().strip()
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(b"POST /v1/memories/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Authorization: Bearer " + key.encode() + b"\r\n"
                            b"Content-Length: 100\r\n\r\n{\"query\": ")
            time.sleep(0.5)
            started = time.monotonic()
            os.kill(process[0], signal.SIGTERM)
            while _alive(process[0]) and time.monotonic() - started < 60:
                time.sleep(0.5)
            assert not _alive(process[0]), "still running 60 s after SIGTERM"
            assert 25 < time.monotonic() - started < 45  # it waited for the request in hand, then gave up


def _serve_processes() -> list[tuple[int, str]]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                pass
    return [p for p in out if " serve " in p[1]]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_database_that_cannot_be_reached_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMORY_SERVER_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/nothing")
    for command in (("keys", "list"), ("keys", "revoke", "key_x"), ("reindex",)):
        result = run_cli(*command, data_dir=tmp_path, check=False)
        assert result.returncode == 1, (command, result.stderr)
        assert "Traceback" not in result.stderr and "error: the database cannot be used: " in result.stderr, result.stderr
