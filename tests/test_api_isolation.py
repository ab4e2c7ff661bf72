"""Isolation over HTTP: users, agents and runs within a tenant, tenants from each other, and key restrictions."""

import time

import httpx
import pytest

MODES = ("hybrid", "dense", "keyword")
FACT = "is allergic to peanuts and carries an epipen"
QUERY = "peanut allergy epipen"


# -- helpers ---------------------------------------------------------------------------------------
def expect_status(response: httpx.Response, *statuses: int) -> httpx.Response:
    if response.status_code >= 500:
        # The server thread is still printing its traceback. On Python 3.11 that and pytest's failure report both
        # run ast.parse, which races between threads (cpython#106905) and can abort the whole pytest session.
        time.sleep(1)
    assert response.status_code in statuses, response.text
    return response


def add(client: httpx.Client, text: str = FACT, **scope) -> str:
    response = client.post("/v1/memories", json={"text": text, **scope})
    (result,) = expect_status(response, 200).json()["results"]
    assert result["event"] == "ADD", result
    return result["id"]


def search_ids(client: httpx.Client, mode: str = "hybrid", query: str = QUERY, **body) -> set[str]:
    response = client.post("/v1/memories/search", json={"query": query, "mode": mode, **body})
    return {memory["id"] for memory in expect_status(response, 200).json()["results"]}


def list_ids(client: httpx.Client, **params) -> set[str]:
    response = client.get("/v1/memories", params={"limit": 200, **params})
    return {memory["id"] for memory in expect_status(response, 200).json()["results"]}


def assert_status(response: httpx.Response, status: int, code: str) -> None:
    assert expect_status(response, status).json()["error"]["code"] == code, response.text


def assert_unreachable(client: httpx.Client, memory_id: str) -> None:
    """GET, PATCH, DELETE and history all answer 404, exactly as for an id that does not exist."""
    path = f"/v1/memories/{memory_id}"
    assert_status(client.get(path), 404, "not_found")
    assert_status(client.patch(path, json={"text": "overwritten by a stranger"}), 404, "not_found")
    assert_status(client.delete(path), 404, "not_found")
    assert_status(client.get(f"{path}/history"), 404, "not_found")


def assert_intact(admin: httpx.Client, memory_id: str, text: str = FACT) -> None:
    assert expect_status(admin.get(f"/v1/memories/{memory_id}"), 200).json()["memory"] == text
    history = admin.get(f"/v1/memories/{memory_id}/history").json()["results"]
    assert [entry["event"] for entry in history] == ["ADD"]


def new_key(admin: httpx.Client, role: str = "agent", **restrictions) -> tuple[str, str]:
    """(key id, plaintext key), made through the admin API."""
    created = expect_status(admin.post("/v1/admin/keys", json={"role": role, **restrictions}), 201).json()
    return created["id"], created["key"]


@pytest.fixture
def admin(server):
    with server.client() as c:
        yield c


@pytest.fixture
def keys(server):
    """Open a client for a key; all are closed at the end of the test."""
    opened: list[httpx.Client] = []

    def open_client(key: str) -> httpx.Client:
        opened.append(server.client(key))
        return opened[-1]

    yield open_client
    for c in opened:
        c.close()


# -- scopes within one tenant ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["user_id", "agent_id", "run_id"])
def test_scope_ids_isolate_search_and_list_in_every_mode(admin, kind):
    alice = add(admin, **{kind: "alice"})
    bob = add(admin, **{kind: "bob"})  # the same text: only the scope tells them apart
    for mode in MODES:
        assert search_ids(admin, mode, **{kind: "bob"}) == {bob}, mode
        assert search_ids(admin, mode, filters={kind: "alice"}) == {alice}, mode
        assert search_ids(admin, mode, filters={kind: {"in": ["bob", "carol"]}}) == {bob}, mode
    assert list_ids(admin, **{kind: "bob"}) == {bob}
    assert list_ids(admin, **{kind: "alice"}) == {alice}


def test_memories_differing_only_in_run_stay_apart_within_one_user(admin):
    morning = add(admin, user_id="alice", run_id="morning")
    evening = add(admin, user_id="alice", run_id="evening")
    for mode in MODES:
        assert search_ids(admin, mode, user_id="alice", run_id="evening") == {evening}, mode
    assert list_ids(admin, user_id="alice", run_id="morning") == {morning}
    assert admin.delete("/v1/memories", params={"user_id": "alice", "run_id": "morning"}).json() == {"deleted": 1}
    assert list_ids(admin, user_id="alice") == {evening}


# -- tenants ---------------------------------------------------------------------------------------
def test_other_tenant_gets_404_for_memory_ids(server, admin, keys):
    memory = add(admin, user_id="alice")
    other = keys(server.create_tenant_key("other", role="admin"))
    assert_unreachable(other, memory)
    assert_intact(admin, memory)


def test_other_tenant_never_sees_memories_even_with_the_same_user_id(server, admin, keys):
    memory = add(admin, user_id="alice", agent_id="helper", run_id="r1")
    other = keys(server.create_tenant_key("other", role="admin"))
    for mode in MODES:
        assert search_ids(other, mode, user_id="alice") == set(), mode
        assert search_ids(other, mode, filters={"OR": [{"agent_id": "helper"}, {"run_id": "r1"}]}) == set(), mode
    assert list_ids(other) == set()
    assert list_ids(other, user_id="alice") == set()
    assert other.delete("/v1/memories", params={"user_id": "alice"}).json() == {"deleted": 0}
    assert_intact(admin, memory)


def test_identical_memory_in_other_tenant_is_stored_separately(server, admin, keys):
    ours = add(admin, user_id="alice")
    other = keys(server.create_tenant_key("other", role="agent"))
    theirs = add(other, user_id="alice")  # not a NOOP pointing at our id: deduplication is per tenant
    assert theirs != ours
    for mode in MODES:
        assert search_ids(admin, mode, user_id="alice") == {ours}, mode
        assert search_ids(other, mode, user_id="alice") == {theirs}, mode
    assert other.delete(f"/v1/memories/{theirs}").json() == {"deleted": 1}
    assert_intact(admin, ours)


def test_other_tenant_memories_do_not_crowd_out_search_results(server, admin, keys):
    ours = add(admin, user_id="alice")
    other = keys(server.create_tenant_key("other", role="agent"))
    for text in (QUERY, f"alice has a {QUERY}", f"{QUERY} since childhood"):  # closer to the query than ours
        add(other, text, user_id="alice")
    for mode in MODES:
        assert search_ids(admin, mode, user_id="alice", top_k=1) == {ours}, mode


def test_admin_key_sees_its_whole_tenant_but_no_other_tenant(server, admin, keys):
    ours = {add(admin, user_id="alice"), add(admin, user_id="bob"), add(admin, agent_id="helper")}
    other = keys(server.create_tenant_key("other", role="admin"))
    theirs = {add(other, user_id="alice"), add(other, agent_id="helper")}
    assert list_ids(admin) == ours
    assert list_ids(other) == theirs
    anyone = {"OR": [{"user_id": {"in": ["alice", "bob"]}}, {"agent_id": "helper"}]}
    for mode in MODES:
        assert search_ids(admin, mode, filters=anyone) == ours, mode
        assert search_ids(other, mode, filters=anyone) == theirs, mode
    for memory in theirs:
        assert_status(admin.get(f"/v1/memories/{memory}"), 404, "not_found")


def test_admin_cannot_see_or_revoke_keys_of_other_tenant(server, admin, keys):
    other = keys(server.create_tenant_key("other", role="admin"))
    other_key_ids = {k["id"] for k in other.get("/v1/admin/keys").json()["results"]}
    assert other_key_ids
    our_keys = admin.get("/v1/admin/keys").json()["results"]
    assert {k["tenant_id"] for k in our_keys} == {"default"}
    assert not other_key_ids & {k["id"] for k in our_keys}
    for key_id in other_key_ids:
        assert_status(admin.delete(f"/v1/admin/keys/{key_id}"), 404, "not_found")
    expect_status(other.get("/v1/memories"), 200)


def test_keys_created_by_an_admin_belong_to_its_tenant(server, admin, keys):
    other_admin = keys(server.create_tenant_key("other", role="admin"))
    _, key = new_key(other_admin, "agent", user_ids=["alice"])
    memory = add(keys(key), user_id="alice")
    assert list_ids(other_admin) == {memory}
    assert list_ids(admin) == set()


# -- keys restricted to users ----------------------------------------------------------------------
@pytest.fixture
def alice_only(server, keys):
    return keys(server.create_key("agent", user_ids=["alice"]))


FORBIDDEN_SEARCHES = [
    ("top-level user_id", {"user_id": "bob"}),
    ("filter user_id", {"filters": {"user_id": "bob"}}),
    ("explicit eq", {"filters": {"user_id": {"eq": "bob"}}}),
    ("inside OR", {"filters": {"OR": [{"user_id": "alice"}, {"user_id": "bob"}]}}),
    ("via in", {"filters": {"user_id": {"in": ["alice", "bob"]}}}),
    ("nested AND", {"filters": {"AND": [{"run_id": "r1"}, {"OR": [{"user_id": "bob"}, {"agent_id": "x"}]}]}}),
    ("double negation", {"filters": {"NOT": [{"NOT": [{"user_id": "bob"}]}]}}),
    ("own id at top, other in filters", {"user_id": "alice", "filters": {"user_id": "bob"}}),
]


def test_user_restricted_key_cannot_search_other_user(admin, alice_only, subtests):
    add(admin, user_id="bob")
    for name, body in FORBIDDEN_SEARCHES:
        with subtests.test(name):
            response = alice_only.post("/v1/memories/search", json={"query": QUERY, **body})
            assert_status(response, 403, "forbidden")


def test_user_restricted_key_cannot_widen_its_scope_with_negation(admin, alice_only):
    bob = add(admin, user_id="bob")
    carol = add(admin, user_id="carol", agent_id="helper")
    for filters in ({"user_id": {"ne": "alice"}}, {"user_id": {"nin": ["alice"]}}, {"NOT": [{"user_id": "alice"}]},
                    {"agent_id": "helper"}):
        response = alice_only.post("/v1/memories/search", json={"query": QUERY, "filters": filters})
        if expect_status(response, 200, 403).status_code == 200:
            assert not {m["id"] for m in response.json()["results"]} & {bob, carol}, filters


def test_user_restricted_key_cannot_list_or_delete_other_user(admin, alice_only):
    bob = add(admin, user_id="bob", run_id="shared")
    assert_status(alice_only.get("/v1/memories", params={"user_id": "bob"}), 403, "forbidden")
    assert_status(alice_only.delete("/v1/memories", params={"user_id": "bob"}), 403, "forbidden")
    assert_status(alice_only.delete("/v1/memories", params={"user_id": "bob", "run_id": "shared"}), 403, "forbidden")
    assert_intact(admin, bob)


def test_user_restricted_key_cannot_add_for_other_user(admin, alice_only):
    assert_status(alice_only.post("/v1/memories", json={"text": FACT, "user_id": "bob"}), 403, "forbidden")
    items = [{"text": "alice likes tea", "user_id": "alice"}, {"text": "bob likes coffee", "user_id": "bob"}]
    assert_status(alice_only.post("/v1/memories/batch", json={"items": items}), 403, "forbidden")
    assert list_ids(admin) == set()  # all-or-nothing: not even alice's item was stored


def test_user_restricted_key_gets_404_for_other_users_memory(admin, alice_only):
    bob = add(admin, user_id="bob")
    no_user = add(admin, agent_id="helper")  # belongs to no user, so not to alice either
    for memory in (bob, no_user):
        assert_unreachable(alice_only, memory)
        assert_intact(admin, memory)


def test_user_restricted_key_can_use_its_own_memories(admin, alice_only):
    mine = add(alice_only, user_id="alice")
    assert alice_only.get(f"/v1/memories/{mine}").json()["user_id"] == "alice"
    updated = alice_only.patch(f"/v1/memories/{mine}", json={"text": "alice no longer has peanut allergy"})
    assert expect_status(updated, 200).json()["user_id"] == "alice", updated.text
    assert len(alice_only.get(f"/v1/memories/{mine}/history").json()["results"]) == 2
    assert alice_only.delete(f"/v1/memories/{mine}").json() == {"deleted": 1}


def test_user_restricted_key_writes_land_on_its_user_when_user_id_is_omitted(admin, alice_only):
    batch = alice_only.post("/v1/memories/batch", json={"items": [{"text": "alice walks daily", "run_id": "r2"}]})
    written = [add(alice_only), add(alice_only, "alice drinks oolong", agent_id="helper", run_id="r1"),
               expect_status(batch, 200).json()["results"][0]["id"]]
    for memory_id in written:
        assert admin.get(f"/v1/memories/{memory_id}").json()["user_id"] == "alice"


def test_user_restricted_key_only_sees_its_user_when_user_id_is_omitted(admin, alice_only):
    mine = add(admin, user_id="alice", agent_id="helper")
    bob = add(admin, user_id="bob", agent_id="helper")
    add(admin, agent_id="helper")
    for mode in MODES:
        assert search_ids(alice_only, mode) == {mine}, mode
        assert search_ids(alice_only, mode, agent_id="helper") == {mine}, mode
    assert list_ids(alice_only) == {mine}
    assert list_ids(alice_only, agent_id="helper") == {mine}
    assert bob not in list_ids(alice_only, agent_id="helper")


def test_user_restricted_key_deleting_by_other_scope_only_touches_its_user(admin, alice_only):
    mine = add(admin, user_id="alice", agent_id="helper", run_id="r1")
    bob = add(admin, user_id="bob", agent_id="helper", run_id="r1")
    unowned = add(admin, agent_id="helper", run_id="r1")
    assert alice_only.delete("/v1/memories", params={"agent_id": "helper"}).json() == {"deleted": 1}
    assert alice_only.delete("/v1/memories", params={"run_id": "r1"}).json() == {"deleted": 0}
    assert list_ids(admin) == {bob, unowned}
    assert_status(admin.get(f"/v1/memories/{mine}"), 404, "not_found")


def test_key_restricted_to_several_users_must_name_one_to_write(server, admin, keys):
    two = keys(server.create_key("agent", user_ids=["alice", "carol"]))
    response = two.post("/v1/memories", json={"text": FACT})
    assert_status(response, 403, "forbidden")
    assert response.json()["error"]["field"] == "user_id"
    alice, carol = add(two, user_id="alice"), add(two, user_id="carol")
    add(admin, user_id="bob")
    for mode in MODES:
        assert search_ids(two, mode) == {alice, carol}, mode
    assert list_ids(two) == {alice, carol}
    assert_status(two.post("/v1/memories", json={"text": FACT, "user_id": "bob"}), 403, "forbidden")


# -- keys restricted to agents ---------------------------------------------------------------------
@pytest.fixture
def helper_only(server, keys):
    return keys(server.create_key("agent", agent_ids=["helper"]))


def test_agent_restricted_key_cannot_reach_other_agent(admin, helper_only):
    stranger = add(admin, user_id="alice", agent_id="stranger")
    for body in ({"agent_id": "stranger"}, {"filters": {"OR": [{"agent_id": "helper"}, {"agent_id": "stranger"}]}},
                 {"filters": {"agent_id": {"in": ["helper", "stranger"]}}}):
        assert_status(helper_only.post("/v1/memories/search", json={"query": QUERY, **body}), 403, "forbidden")
    assert_status(helper_only.get("/v1/memories", params={"agent_id": "stranger"}), 403, "forbidden")
    assert_status(helper_only.delete("/v1/memories", params={"agent_id": "stranger"}), 403, "forbidden")
    response = helper_only.post("/v1/memories", json={"text": FACT, "user_id": "alice", "agent_id": "stranger"})
    assert_status(response, 403, "forbidden")
    assert_unreachable(helper_only, stranger)
    assert_intact(admin, stranger)
    assert list_ids(admin) == {stranger}


def test_agent_restricted_key_writes_and_reads_only_its_agent(admin, helper_only):
    theirs = add(admin, user_id="alice", agent_id="stranger")
    no_agent = add(admin, user_id="alice")
    mine = add(helper_only, user_id="alice")  # agent_id omitted: the key's own agent is filled in
    assert admin.get(f"/v1/memories/{mine}").json()["agent_id"] == "helper"
    for mode in MODES:
        assert search_ids(helper_only, mode, user_id="alice") == {mine}, mode
    assert list_ids(helper_only, user_id="alice") == {mine}
    assert helper_only.delete("/v1/memories", params={"user_id": "alice"}).json() == {"deleted": 1}
    assert list_ids(admin) == {theirs, no_agent}


# -- key management and revocation -----------------------------------------------------------------
def test_agent_keys_cannot_manage_keys(server, admin, keys):
    agents = (keys(server.create_key("agent")), keys(server.create_key("agent", user_ids=["alice"])))
    before = admin.get("/v1/admin/keys").json()["results"]
    admin_key_id = before[0]["id"]
    for agent in agents:
        assert_status(agent.get("/v1/admin/keys"), 403, "forbidden")
        assert_status(agent.post("/v1/admin/keys", json={"role": "admin"}), 403, "forbidden")
        assert_status(agent.post("/v1/admin/keys", json={"role": "agent"}), 403, "forbidden")
        assert_status(agent.delete(f"/v1/admin/keys/{admin_key_id}"), 403, "forbidden")
    after = admin.get("/v1/admin/keys").json()["results"]
    assert [k["id"] for k in after] == [k["id"] for k in before]
    assert all(k["revoked_at"] is None for k in after)


def test_revoked_key_gets_401_immediately(admin, keys):
    key_id, key = new_key(admin, "agent", user_ids=["alice"])
    client = keys(key)
    memory = add(client, user_id="alice")
    assert admin.delete(f"/v1/admin/keys/{key_id}").json()["revoked_at"] is not None
    # The same keep-alive connection, the very next request: no grace period, no cache.
    assert_status(client.get(f"/v1/memories/{memory}"), 401, "unauthorized")
    assert_status(client.post("/v1/memories/search", json={"query": QUERY}), 401, "unauthorized")
    assert_status(client.post("/v1/memories", json={"text": "after revocation"}), 401, "unauthorized")
    assert_status(client.delete(f"/v1/memories/{memory}"), 401, "unauthorized")
    assert list_ids(admin) == {memory}


def test_revoked_admin_key_can_no_longer_manage_keys(server, admin, keys):
    key_id, key = new_key(admin, "admin")
    second_admin = keys(key)
    expect_status(second_admin.get("/v1/admin/keys"), 200)
    expect_status(admin.delete(f"/v1/admin/keys/{key_id}"), 200)
    assert_status(second_admin.get("/v1/admin/keys"), 401, "unauthorized")
    assert_status(second_admin.post("/v1/admin/keys", json={"role": "admin"}), 401, "unauthorized")


def test_restricted_admin_keys_cannot_manage_keys(server, admin, keys):
    """An admin key restricted to alice could once make itself an unrestricted admin key (and read
    bob's memories with it), list every key of the tenant and revoke the bootstrap key."""
    restricted = keys(server.create_key("admin", user_ids=["alice"]))
    bobs = add(admin, user_id="bob")
    before = admin.get("/v1/admin/keys").json()["results"]
    assert_status(restricted.get("/v1/admin/keys"), 403, "forbidden")
    for body in ({"role": "admin"}, {"role": "agent"}, {"role": "admin", "user_ids": ["alice"]}):
        assert_status(restricted.post("/v1/admin/keys", json=body), 403, "forbidden")
    for key in before:
        assert_status(restricted.delete(f"/v1/admin/keys/{key['id']}"), 403, "forbidden")
    assert admin.get("/v1/admin/keys").json()["results"] == before
    # Within its user it is still an admin key; beyond it, nothing.
    alices = add(restricted, user_id="alice")
    assert list_ids(restricted) == {alices}
    assert_unreachable(restricted, bobs)


def _cli_revoke(settings, key_id: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if settings.database_url:
        env["MEMORY_SERVER_DATABASE_URL"] = settings.database_url
    done = subprocess.run([sys.executable, "-m", "memory_server", "keys", "revoke", key_id,
                           "--data-dir", str(settings.data_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_revocation_reaches_every_server_on_the_data_directory_at_once(server, admin, embedder):
    """Two servers on one data directory (the workers of `serve --workers 2`), keys cached for 5 s:
    a key revoked through one (or by the CLI) was still taken by the other for up to those 5 s."""
    from conftest import start_server

    assert server.settings.key_cache_seconds >= 5
    other, stop = start_server(server.settings, embedder)
    try:
        for revoke in ("api", "cli"):
            key_id, key = new_key(admin, "agent", user_ids=["alice"])
            here, there = server.client(key), other.client(key)
            with here, there:
                add(here, text=f"Alice revoked a key through the {revoke}", user_id="alice")
                expect_status(there.get("/v1/memories"), 200)  # cached there now
                if revoke == "api":
                    expect_status(admin.delete(f"/v1/admin/keys/{key_id}"), 200)
                else:
                    _cli_revoke(server.settings, key_id)
                for client in (there, here):
                    assert_status(client.get("/v1/memories"), 401, "unauthorized")
                    assert_status(client.post("/v1/memories", json={"text": "after revocation"}), 401, "unauthorized")
    finally:
        stop()


def test_a_key_verified_while_it_is_revoked_is_not_cached(server, admin):
    """A request that read the key just before a revocation committed, and cached it just after
    the revocation cleared the cache, kept a revoked key working for the cache's whole lifetime
    (4 of 40 tries over HTTP). The revocation's clear now outdates such a verification."""
    from memory_server.auth import Principal

    cache = server.app.state.runtime.keys
    principal = Principal("default", "key_in_flight", "agent")
    generation = cache.generation  # the request starts verifying
    cache.clear()  # the revocation lands meanwhile
    assert cache.put("msk_in_flight", principal, generation) is principal  # the request itself goes on
    assert cache.peek("msk_in_flight") is None  # the next one verifies again
    generation = cache.generation
    cache.put("msk_in_flight", principal, generation)
    assert cache.peek("msk_in_flight") is principal


def test_the_revocation_file_replaced_or_rewritten_at_its_size_still_clears_the_cache(tmp_path):
    """The cache watched the revocation file's size only: a file replaced by another of the same
    length (a restore, a log rotation) or truncated and written again to that length between two
    lookups went unseen, and revoked keys stayed cached (session 27's note). (The revocation count
    shows no such change: the cache stats the file too, here at every lookup.)"""
    import os

    from memory_server.auth import KeyCache, Principal

    revocations = tmp_path / "revocations"
    revocations.write_text("2026-12-04T00:00:00 key_a\n")
    cache = KeyCache(ttl=60, revocations=revocations, stat_seconds=0)  # the file stat-ed at every lookup
    principal = Principal("default", "key_b", "agent")

    def cached() -> bool:
        cache.put("msk_b", principal, cache.generation)
        return cache.peek("msk_b") is principal

    assert cached()
    replacement = tmp_path / "replacement"
    replacement.write_text("2026-12-04T00:00:00 key_b\n")  # the same length, another inode
    os.replace(replacement, revocations)
    assert cache.peek("msk_b") is None
    assert cached()
    stat = revocations.stat()
    revocations.write_text("2026-12-04T00:00:01 key_b\n")  # truncated and written again in place
    os.utime(revocations, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # whatever the clock's grain
    assert revocations.stat().st_size == stat.st_size and revocations.stat().st_ino == stat.st_ino
    assert cache.peek("msk_b") is None
    assert cached()
    revocations.unlink()  # removed: also a change
    assert cache.peek("msk_b") is None


def test_a_revocation_in_another_process_clears_the_cache_at_once_without_a_system_call(tmp_path, monkeypatch):
    """Every lookup stat-ed the revocation file; under load the event loop then waited to get the
    interpreter's lock back (bench/analysis.md, round 42). A revocation now also adds one to a
    shared count that a lookup reads from memory; the file is stat-ed once a second, for changes
    the count does not show."""
    import os
    import subprocess
    import sys

    from memory_server.auth import REVOCATIONS_FILE, KeyCache, Principal

    revocations = tmp_path / REVOCATIONS_FILE
    principal = Principal("default", "key_b", "agent")
    cache = KeyCache(ttl=60, revocations=revocations, stat_seconds=3600)
    rarely = KeyCache(ttl=60, revocations=revocations, stat_seconds=0.2)
    try:
        for each in (cache, rarely):
            each.put("msk_b", principal, each.generation)
        stats = []
        real_stat = os.stat
        monkeypatch.setattr(os, "stat", lambda path, *a, **k: stats.append(str(path)) or real_stat(path, *a, **k))
        assert cache.peek("msk_b") is principal
        assert str(revocations) not in stats  # no system call a lookup
        # Another process (a worker, or `memory-server keys revoke`) records a revocation.
        script = ("import sys\nfrom pathlib import Path\nfrom memory_server.auth import record_revocation\n"
                  "assert record_revocation(Path(sys.argv[1]), 'key_x')\n")
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert revocations.read_text().endswith(" key_x\n")
        assert cache.peek("msk_b") is None  # at once
        cache.put("msk_b", principal, cache.generation)
        stats.clear()  # the clear read the file's state once
        assert cache.peek("msk_b") is principal
        assert str(revocations) not in stats
        # A change the count does not show (the file replaced, as by a restore) is seen at the next stat.
        assert rarely.peek("msk_b") is None  # the count moved
        rarely.put("msk_b", principal, rarely.generation)
        replacement = tmp_path / "replacement"
        replacement.write_text("2026-12-04T00:00:00 key_b\n")
        os.replace(replacement, revocations)
        deadline = time.monotonic() + 5
        while rarely.peek("msk_b") is principal and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rarely.peek("msk_b") is None
        assert cache.peek("msk_b") is principal  # a whole hour between its stats
    finally:
        cache.close()
        rarely.close()


def test_metrics_are_for_the_operators_unrestricted_admin_keys(server, admin):
    """/metrics counts every tenant's requests and memories: another tenant's admin watched them."""
    other_tenant = server.create_tenant_key("tB", "admin")
    restricted = server.create_key("admin", user_ids=["alice"])
    for key in (other_tenant, restricted):
        with server.client(key) as c:
            assert_status(c.get("/metrics"), 403, "forbidden")
    expect_status(admin.get("/metrics"), 200)


def test_a_revocation_file_that_cannot_be_written_still_revokes(server, admin, keys, caplog):
    """The revocation was committed, then writing the file failed: a 500, and the key kept working
    (the cache was cleared only after the write). A review of session 27's change."""
    revocations = server.settings.data_dir / "revocations"
    revocations.unlink(missing_ok=True)
    revocations.mkdir()  # unwritable as a file, even for root
    try:
        key_id, key = new_key(admin, "agent", user_ids=["alice"])
        client = keys(key)
        expect_status(client.get("/v1/memories"), 200)  # cached
        with caplog.at_level("ERROR", logger="memory_server"):
            assert expect_status(admin.delete(f"/v1/admin/keys/{key_id}"), 200).json()["revoked_at"] is not None
        assert "could not be written" in caplog.text
        assert_status(client.get("/v1/memories"), 401, "unauthorized")
    finally:
        revocations.rmdir()
