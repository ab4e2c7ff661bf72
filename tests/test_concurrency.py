"""Many clients writing at once through two workers on one data directory (what `serve --workers 2`
runs): random adds (some expiring within a second or two), batches, updates, deletes and scope
deletes, and each client's own writes read back at once through the other worker; then the
invariants checked — no request failed, both workers' indexes hold exactly what the database
holds, every memory's history follows on from itself, and exact-text dedup held across requests
and workers."""

import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest

from conftest import start_server

STEPS = 60  # per client; 120 found the update-after-commit bug about one run in four
USERS = ["ana", "ben", "cy"]
FACTS = ["{u} keeps bees on the roof", "{u} is allergic to peanuts", "{u} drives a blue electric car",
         "{u} moved to Lisbon in 2019", "{u} plays tennis every Saturday", "{u} is learning Portuguese",
         "{u} works night shifts at the hospital", "{u} has a cat named Miso", "{u} ordered O-{n} last week"]


@pytest.fixture
def two_workers(settings, embedder):
    first, stop_first = start_server(settings, embedder)
    second, stop_second = start_server(settings, embedder)
    yield first, second
    stop_second()
    stop_first()


def _fact(rng: random.Random, user: str) -> str:
    return rng.choice(FACTS).format(u=user.capitalize(), n=rng.randint(1000, 1003))


def _client_run(workers, seed: int) -> tuple[set[str], list[tuple[str, int, str]], str | None]:
    """One client's random run; returns the ids it saw, its unexpected answers, and the id of its
    own expiring note: a memory of its own scope, unlike any other text, that no client deletes or
    changes, which the expiry sweep purges while the clients write (the random expiring adds alone
    once left the sweep nothing to purge, in CI in session 43: most likely each was a duplicate of
    a stored text, or a client deleted or changed it first)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    unexpected = []
    clients = [w.client() for w in workers]
    note = None
    try:
        soon = datetime.now(timezone.utc) + timedelta(seconds=1)
        response = clients[seed % 2].post("/v1/memories", json={
            "text": f"client {seed} parked in bay {seed} until the note expires", "user_id": f"own-{seed}",
            "expires_at": soon.isoformat()})
        if response.status_code == 200:
            note = response.json()["results"][0]["id"]
        else:
            unexpected.append(("note", response.status_code, response.text))
        for step in range(STEPS):
            here = rng.randrange(len(clients))
            c = clients[here]
            user = rng.choice(USERS)
            op = rng.choices(["add", "expiring", "batch", "update", "delete", "delete_scope", "search", "own"],
                             [25, 8, 15, 20, 12, 3, 20, 6])[0]
            if op == "own":  # read your writes across workers, while both are busy with the others
                text = f"client {seed} noted zebra{step}x{seed}"
                response = c.post("/v1/memories", json={"text": text, "user_id": f"own-{seed}"})
                if response.status_code == 200:
                    other = clients[1 - here]
                    memory_id = response.json()["results"][0]["id"]
                    hits = other.post("/v1/memories/search", json={"query": f"zebra{step}x{seed}", "mode": "keyword",
                                                                   "filters": {"user_id": f"own-{seed}"}}).json()
                    if [h["id"] for h in hits.get("results", [])] != [memory_id]:
                        unexpected.append(("own: the other worker's search", 200, str(hits)))
                    if other.get(f"/v1/memories/{memory_id}").status_code != 200:
                        unexpected.append(("own: the other worker's get", 200, memory_id))
                    continue
            elif op == "add":
                response = c.post("/v1/memories", json={"text": _fact(rng, user), "user_id": user})
            elif op == "expiring":  # gone within a second or two, by the expiry sweep
                soon = datetime.now(timezone.utc) + timedelta(seconds=rng.uniform(0.2, 1.5))
                response = c.post("/v1/memories", json={"text": _fact(rng, user), "user_id": user,
                                                        "expires_at": soon.isoformat()})
            elif op == "batch":
                items = [{"text": _fact(rng, user), "user_id": user} for _ in range(rng.randint(2, 4))]
                response = c.post("/v1/memories/batch", json={"items": items})
            elif op in ("update", "delete") and seen:
                memory_id = rng.choice(sorted(seen))
                if op == "update":  # texts no add makes, so exact-text dedup stays checkable
                    body = {"text": f"changed by client {seed} at step {step}", "metadata": {"by": seed}}
                    if rng.random() < 0.3:  # kept for good, or set to expire soon
                        body["expires_at"] = rng.choice([None, (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()])
                    response = c.patch(f"/v1/memories/{memory_id}", json=body)
                else:
                    response = c.delete(f"/v1/memories/{memory_id}")
                if response.status_code == 404:  # deleted by another client meanwhile
                    continue
            elif op == "delete_scope":
                response = c.delete("/v1/memories", params={"user_id": user})
            else:
                response = c.post("/v1/memories/search", json={"query": _fact(rng, user), "filters": {"user_id": user}})
            if response.status_code != 200:
                unexpected.append((op, response.status_code, response.text))
            elif op in ("add", "expiring", "batch"):
                seen.update(r["id"] for r in response.json()["results"])
    finally:
        for c in clients:
            c.close()
    return seen, unexpected, note


def test_many_clients_writing_through_two_workers_leave_a_consistent_store(two_workers):
    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda seed: _client_run(two_workers, seed), range(6)))
    assert [u for _, unexpected, _ in runs for u in unexpected] == []
    ids = set().union(*(seen for seen, _, _ in runs))
    first, second = two_workers
    time.sleep(3)  # every expiry has passed and the sweep (every 0.5 s in tests) has purged them
    with first.client() as c1, second.client() as c2:
        live = {}
        for user in USERS:
            listed = c1.get("/v1/memories", params={"user_id": user, "limit": 200}).json()
            assert listed["next_cursor"] is None
            assert c2.get("/v1/memories", params={"user_id": user, "limit": 200}).json() == listed
            memories = {m["id"]: m["memory"] for m in listed["results"]}
            texts = list(memories.values())
            assert len(texts) == len(set(texts)), f"{user} holds the same text twice"
            for c in (c1, c2):  # each worker's index holds exactly the live memories, as stored
                hits = c.post("/v1/memories/search", json={"query": f"what about {user}", "mode": "dense",
                                                           "top_k": 100, "filters": {"user_id": user}}).json()
                assert {h["id"]: h["memory"] for h in hits["results"]} == memories
            live.update(memories)
        assert set(live) <= ids
        for memory_id in ids:
            history = c2.get(f"/v1/memories/{memory_id}/history").json()["results"]
            events = [e["event"] for e in history]
            assert events[0] == "ADD" and set(events[1:-1]) <= {"UPDATE"}, events
            for before, after in zip(history, history[1:]):
                assert after["old_memory"] == before["new_memory"]
            if memory_id in live:
                assert events[-1] != "DELETE" and history[-1]["new_memory"] == live[memory_id]
            else:  # deleted by a client or purged by the sweep once it expired
                assert events[-1] == "DELETE"
                assert c1.get(f"/v1/memories/{memory_id}").status_code == 404
        # The sweep took part: each client's own note expired a second into the run and was purged.
        for _, _, note in runs:
            history = c1.get(f"/v1/memories/{note}/history").json()["results"]
            assert [e["event"] for e in history] == ["ADD", "DELETE"] and history[-1]["actor"] == "system:expiry"
            assert c2.get(f"/v1/memories/{note}").status_code == 404


def test_a_near_duplicate_added_through_the_other_worker_is_a_noop(tmp_path, database_url, embedder):
    """The near-duplicate check asks the process's own index, which followed the other worker's
    writes only before a search or on the maintenance thread's next round: the same fact reworded
    slightly and sent to the other worker right after the first was answered was stored twice
    (10 of 10 across PostgreSQL replicas, 5 of 6 across `--workers 2`; a review, session 28). The
    maintenance thread waits an hour here, so only the add itself can have followed."""
    from conftest import make_settings

    settings = make_settings(tmp_path / "data", database_url, sync_interval_seconds=3600)
    first, stop_first = start_server(settings, embedder)
    second, stop_second = start_server(settings, embedder)
    try:
        with first.client() as here, second.client() as there:
            for n in range(3):
                text = f"My dentist appointment is on Tuesday the {n + 3}rd at 10am downtown"
                (stored,) = here.post("/v1/memories", json={"text": text, "user_id": "dee"}).json()["results"]
                assert stored["event"] == "ADD"
                (again,) = there.post("/v1/memories", json={"text": text + "!", "user_id": "dee"}).json()["results"]
                assert (again["event"], again["id"]) == ("NOOP", stored["id"]), again
            assert len(there.get("/v1/memories", params={"user_id": "dee"}).json()["results"]) == 3
    finally:
        stop_second()
        stop_first()
