"""Vector memory behaviour through the real HTTP server: search semantics, dedup, expiry, history, updates."""

import time
from datetime import datetime, timedelta, timezone

import pytest

FOODS = [
    "Alice is allergic to peanuts",
    "Alice's favourite cuisine is Japanese, especially sushi",
    "Alice works as a nurse at the city hospital",
    "Alice has a golden retriever named Biscuit",
    "Alice plays tennis every Saturday morning",
    "Alice is learning to speak Portuguese",
    "Alice's order O-1001 was delivered late",
    "Alice drives a blue electric car",
]


def add(c, text, **fields):
    body = {"text": text, "user_id": "alice", **fields}
    response = c.post("/v1/memories", json=body)
    assert response.status_code == 200, response.text
    return response.json()["results"][0]


def search(c, query, **body):
    body.setdefault("filters", {"user_id": "alice"})
    response = c.post("/v1/memories/search", json={"query": query, **body})
    assert response.status_code == 200, response.text
    return response.json()["results"]


@pytest.fixture
def alice(server):
    with server.client() as c:
        response = c.post("/v1/memories/batch", json={"items": [{"text": t, "user_id": "alice"} for t in FOODS]})
        assert response.status_code == 200, response.text
        yield c


def test_add_returns_id_and_event_and_get_reads_it_back(server):
    with server.client() as c:
        result = add(c, "Bob prefers window seats", user_id="bob", metadata={"topic": "travel"})
        assert result["event"] == "ADD"
        got = c.get(f"/v1/memories/{result['id']}").json()
        assert got["memory"] == "Bob prefers window seats"
        assert got["user_id"] == "bob" and got["agent_id"] is None and got["metadata"] == {"topic": "travel"}
        assert got["hash"] and got["created_at"].endswith("Z") or "+00:00" in got["created_at"]


def test_a_search_hit_carries_the_memory_exactly_as_get_reads_it(server):
    # Searches read their hits' rows through the driver's cursor (storage/db.py: driver_rows),
    # reads through the ORM: the same fields, times and metadata on every database.
    expires = (datetime.now(timezone.utc) + timedelta(days=3)).isoformat()
    metadata = {"topic": "travel", "seats": [1, 2.5, True, None], "nested": {"k": "v", "n": -7}, "note": "ünï 中文"}
    with server.client() as c:
        first = add(c, "Bob prefers window seats on long flights", user_id="bob", agent_id="planner", run_id="r1",
                    metadata=metadata, expires_at=expires)
        second = add(c, "Bob collects stamps from Iceland", user_id="bob")
        for mode in ("hybrid", "dense", "keyword"):
            hits = {hit["id"]: hit for hit in search(c, "Bob window seats stamps", filters={"user_id": "bob"}, mode=mode)}
            for added in (first, second):
                got = c.get(f"/v1/memories/{added['id']}").json()
                assert {k: v for k, v in hits[added["id"]].items() if k != "score"} == got, mode
    assert got["metadata"] == {} and hits[first["id"]]["metadata"] == metadata
    assert hits[first["id"]]["expires_at"] is not None and hits[second["id"]]["expires_at"] is None


def test_messages_store_each_non_system_message_with_its_role(server):
    with server.client() as c:
        response = c.post("/v1/memories", json={"user_id": "carol", "messages": [
            {"role": "system", "content": "You are helpful"},
            {"role": "user", "content": "I moved to Lisbon last spring"},
            {"role": "assistant", "content": "Lisbon is lovely in May"},
        ]})
        results = response.json()["results"]
        assert [r["memory"] for r in results] == ["I moved to Lisbon last spring", "Lisbon is lovely in May"]
        roles = {c.get(f"/v1/memories/{r['id']}").json()["metadata"]["role"] for r in results}
        assert roles == {"user", "assistant"}
        # The role comes last: neither the request's metadata nor the message's own can say otherwise.
        response = c.post("/v1/memories", json={"user_id": "carol", "metadata": {"role": "admin", "k": 1}, "messages": [
            {"role": "user", "content": "My sister lives in Porto", "metadata": {"role": "assistant", "k": 2}}]})
        [result] = response.json()["results"]
        assert c.get(f"/v1/memories/{result['id']}").json()["metadata"] == {"role": "user", "k": 2}


def test_infer_true_falls_back_to_raw_and_says_so(server):
    with server.client() as c:
        body = c.post("/v1/memories", json={"user_id": "dan", "text": "Dan likes jazz", "infer": True}).json()
        assert body["results"][0]["event"] == "ADD"
        assert any("infer" in w for w in body["warnings"])


def test_search_ranks_the_relevant_memory_first_in_every_mode(alice):
    for mode in ("dense", "hybrid"):
        assert search(alice, "Which cuisine does Alice enjoy most?", mode=mode)[0]["memory"] == FOODS[1]
    assert search(alice, "Portuguese lessons", mode="keyword")[0]["memory"] == FOODS[5]


def test_scores_are_in_unit_interval_and_best_first(alice):
    for mode in ("dense", "keyword", "hybrid"):
        results = search(alice, "Alice dog retriever", mode=mode, top_k=8)
        scores = [r["score"] for r in results]
        assert results and all(0.0 <= s <= 1.0 for s in scores)
        assert scores == sorted(scores, reverse=True)


def test_hybrid_score_is_one_when_both_retrievers_rank_it_first(alice):
    top = search(alice, "golden retriever named Biscuit", mode="hybrid")[0]
    assert top["memory"] == FOODS[3] and top["score"] == pytest.approx(1.0)


def test_top_k_limits_the_number_of_results(alice):
    assert len(search(alice, "Alice", mode="dense", top_k=3)) == 3
    assert len(search(alice, "Alice", mode="dense", top_k=100)) == len(FOODS)


def test_threshold_drops_results_below_it(alice):
    everything = search(alice, "pets and animals", mode="dense", top_k=8)
    cut = everything[2]["score"]
    kept = search(alice, "pets and animals", mode="dense", top_k=8, threshold=cut)
    assert [r["id"] for r in kept] == [r["id"] for r in everything if r["score"] >= cut]
    assert search(alice, "pets and animals", mode="dense", threshold=0.99) == []


def test_hybrid_finds_rare_token_that_dense_misses(server):
    with server.client() as c:
        similar = [f"The status of order O-{n} is shipped" for n in (1002, 1010, 1100, 2001, 1000, 7001, 1011, 1021)]
        target = "Package O-1001 left the warehouse in Rotterdam"
        items = [{"text": t, "user_id": "shop"} for t in similar + [target]]
        assert {r["event"] for r in c.post("/v1/memories/batch", json={"items": items}).json()["results"]} == {"ADD"}
        query = "What is the status of order O-1001?"

        def top(mode):
            return [r["memory"] for r in search(c, query, mode=mode, top_k=5, filters={"user_id": "shop"})]

        assert target not in top("dense")
        assert target in top("hybrid")
        assert top("keyword")[0] == target


def test_keyword_search_works_for_chinese(server):
    with server.client() as c:
        texts = ["我喜欢吃四川火锅", "今天北京的天气很好", "下周三我要去上海出差", "我的猫叫小白，它很喜欢睡觉"]
        c.post("/v1/memories/batch", json={"items": [{"text": t, "user_id": "li"} for t in texts]})
        for query, expected in [("火锅", texts[0]), ("上海出差", texts[2]), ("小白", texts[3])]:
            for mode in ("keyword", "hybrid"):
                assert search(c, query, mode=mode, filters={"user_id": "li"})[0]["memory"] == expected


def test_exact_duplicate_in_same_scope_is_noop_with_existing_id(server):
    with server.client() as c:
        first = add(c, "Erin's birthday is on March 3")
        again = add(c, "Erin's birthday is on March 3")
        assert again["event"] == "NOOP" and again["id"] == first["id"]
        elsewhere = add(c, "Erin's birthday is on March 3", user_id="someone-else")
        assert elsewhere["event"] == "ADD" and elsewhere["id"] != first["id"]


def test_near_duplicate_is_noop_but_different_fact_is_added(server):
    with server.client() as c:
        first = add(c, "Frank lives in Berlin, Germany.")
        near = add(c, "Frank lives in Berlin, Germany")
        assert near["event"] == "NOOP" and near["id"] == first["id"]
        assert add(c, "Frank used to live in Madrid")["event"] == "ADD"


def test_duplicates_inside_one_batch_collapse(server):
    with server.client() as c:
        body = {"items": [{"text": "Gina owns a red bicycle", "user_id": "gina"},
                          {"text": "Gina owns a red bicycle.", "user_id": "gina"}]}
        results = c.post("/v1/memories/batch", json=body).json()["results"]
        assert [r["event"] for r in results] == ["ADD", "NOOP"] and results[0]["id"] == results[1]["id"]


def test_the_same_memory_added_at_once_by_many_requests_is_stored_once(server):
    """Retries and parallel writers send the same memory at the same moment: the checks ran before
    any of them committed, so the last one is made under the write lock."""
    from concurrent.futures import ThreadPoolExecutor

    def send(n):
        with server.client() as c:
            if n % 3 == 2:  # a batch repeating it, beside a memory of its own
                body = {"items": [{"text": "Ada moved to Lisbon in 2019", "user_id": "ada"},
                                  {"text": "Ada moved to Lisbon in 2019", "user_id": "ada"},
                                  {"text": f"Ada owns {n + 1} bicycles", "user_id": "ada"}]}
                response = c.post("/v1/memories/batch", json=body)
            else:
                response = c.post("/v1/memories", json={"text": "Ada moved to Lisbon in 2019", "user_id": "ada"})
            assert response.status_code == 200, response.text
            return response.json()["results"]

    for _ in range(3):
        with server.client() as c:
            c.delete("/v1/memories", params={"user_id": "ada"})
        with ThreadPoolExecutor(9) as pool:
            answers = list(pool.map(send, range(9)))
        lisbon = {r["id"] for results in answers for r in results if r["memory"] == "Ada moved to Lisbon in 2019"}
        assert len(lisbon) == 1
        assert sum(r["event"] == "ADD" for results in answers for r in results
                   if r["memory"] == "Ada moved to Lisbon in 2019") <= 1
        with server.client() as c:
            stored = c.get("/v1/memories", params={"user_id": "ada"}).json()["results"]
            assert sorted(m["memory"] for m in stored) == sorted(
                ["Ada moved to Lisbon in 2019"] + [f"Ada owns {n + 1} bicycles" for n in range(2, 9, 3)])
            hits = search(c, "where did Ada move", filters={"user_id": "ada"}, mode="dense")
            assert [h["id"] for h in hits if h["memory"].startswith("Ada moved")] == list(lisbon)


def test_a_memory_changed_and_deleted_by_many_requests_at_once_keeps_a_history_that_follows_on(server):
    """Updates and a delete of one memory at the same moment: each is applied to what the one
    before it left (the history's entries follow on from each other), an update that comes after
    the delete is a 404, never a 500, and the index holds what the database holds."""
    from concurrent.futures import ThreadPoolExecutor

    def change(memory_id, n):
        with server.client() as c:
            if n == "delete":
                return n, c.delete(f"/v1/memories/{memory_id}")
            return n, c.patch(f"/v1/memories/{memory_id}", json={"text": f"Zed now drinks coffee brand {n}",
                                                                   "metadata": {"version": n}})

    for deleting in (True, False, True):
        with server.client() as c:
            c.delete("/v1/memories", params={"user_id": "zed"})
            memory = add(c, "Zed drinks green tea every morning", user_id="zed")
        requests = [0, 1, 2, 3, 4] + (["delete"] if deleting else [])
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda n: change(memory["id"], n), requests))
        assert {r.status_code for _, r in answers} <= {200, 404}, [r.text for _, r in answers]
        updated = [n for n, r in answers if n != "delete" and r.status_code == 200]
        with server.client() as c:
            history = c.get(f"/v1/memories/{memory['id']}/history").json()["results"]
            now = c.get(f"/v1/memories/{memory['id']}")
            hits = search(c, "what does Zed drink", filters={"user_id": "zed"}, mode="dense")
        assert [e["event"] for e in history] == ["ADD"] + ["UPDATE"] * len(updated) + (["DELETE"] if deleting else [])
        for before, after in zip(history, history[1:]):
            assert after["old_memory"] == before["new_memory"]
        if deleting:
            assert now.status_code == 404 and hits == []
        else:
            assert len(updated) == 5
            assert now.json()["memory"] == history[-1]["new_memory"]
            assert now.json()["metadata"] == {"version": int(history[-1]["new_memory"].rsplit(" ", 1)[1])}
            assert [(h["id"], h["memory"]) for h in hits] == [(memory["id"], history[-1]["new_memory"])]


def test_duplicates_are_found_across_a_large_batch_and_the_store(server):
    """Batches are checked in groups (one index query per group): duplicates of stored memories and
    of earlier items in other groups of the same batch are still caught, numbers still matter."""
    with server.client() as c:
        stored = add(c, "Iris keeps her spare key under the blue flowerpot", user_id="iris")
        filler = [{"text": f"Iris noted item number {n} in her garden journal", "user_id": "iris"} for n in range(150)]
        items = filler[:70] + [{"text": "Iris keeps her spare key under the blue flowerpot.", "user_id": "iris"}] \
            + filler[70:] + [{"text": "Iris noted item number 3 in her garden journal.", "user_id": "iris"},
                             {"text": "Iris noted item number 151 in her garden journal", "user_id": "iris"}]
        results = c.post("/v1/memories/batch", json={"items": items}).json()["results"]
        assert len(results) == 153
        assert results[70]["event"] == "NOOP" and results[70]["id"] == stored["id"]
        assert results[151]["event"] == "NOOP" and results[151]["id"] == results[3]["id"]
        assert results[152]["event"] == "ADD"
        assert [r["event"] for r in results[:70] + results[71:151]] == ["ADD"] * 150


def test_exact_duplicates_in_a_batch_of_many_scopes_match_only_their_own_scope(server):
    """The same text stored for many users, for an agent without a user and for one user's agents:
    a batch repeating it across those scopes finds each scope's own copy and no other."""
    text = "Prefers a window seat on long flights"
    with server.client() as c:
        scopes = [{"user_id": "u1"}, {"user_id": "u2"}, {"user_id": "u3"}, {"agent_id": "planner"},
                  {"user_id": "u1", "agent_id": "a"}]
        stored = [c.post("/v1/memories", json={"text": text, **scope}).json()["results"][0]["id"] for scope in scopes]
        batch = [{"user_id": "u2"}, {"user_id": "u4"}, {"agent_id": "planner"}, {"user_id": "u1", "agent_id": "a"},
                 {"user_id": "u1", "agent_id": "b"}, {"agent_id": "scheduler"}]
        results = c.post("/v1/memories/batch", json={"items": [{"text": text, **scope} for scope in batch]}).json()["results"]
        assert [(r["event"], r["id"]) for r in results[:1] + results[2:4]] == [
            ("NOOP", stored[1]), ("NOOP", stored[3]), ("NOOP", stored[4])]
        assert [r["event"] for r in (results[1], results[4], results[5])] == ["ADD", "ADD", "ADD"]
        assert len({r["id"] for r in results} | set(stored)) == len(stored) + 3


def test_expired_memories_never_come_back_and_are_purged(server):
    with server.client() as c:
        soon = (datetime.now(timezone.utc) + timedelta(seconds=1.5)).isoformat()
        short = add(c, "Hank's door code is 4471", user_id="hank", expires_at=soon)
        add(c, "Hank enjoys fishing", user_id="hank")
        assert len(search(c, "door code", filters={"user_id": "hank"})) == 2
        time.sleep(2.0)
        assert [r["memory"] for r in search(c, "door code", filters={"user_id": "hank"})] == ["Hank enjoys fishing"]
        assert c.get(f"/v1/memories/{short['id']}").status_code == 404
        listed = c.get("/v1/memories", params={"user_id": "hank"}).json()["results"]
        assert [m["memory"] for m in listed] == ["Hank enjoys fishing"]
        deadline = time.time() + 10
        while time.time() < deadline:
            history = c.get(f"/v1/memories/{short['id']}/history").json()["results"]
            if history[-1]["event"] == "DELETE":
                break
            time.sleep(0.2)
        assert history[-1]["event"] == "DELETE" and history[-1]["actor"] == "system:expiry"


def test_update_reembeds_so_search_follows_the_new_text(server):
    with server.client() as c:
        memory = add(c, "Ivy's favourite sport is swimming", user_id="ivy")
        add(c, "Ivy reads science fiction novels", user_id="ivy")
        updated = c.patch(f"/v1/memories/{memory['id']}", json={"text": "Ivy's favourite instrument is the cello"})
        assert updated.status_code == 200 and updated.json()["memory"] == "Ivy's favourite instrument is the cello"
        top = search(c, "What music does Ivy play?", mode="dense", filters={"user_id": "ivy"})[0]
        assert top["id"] == memory["id"]
        swim = search(c, "swimming pool", mode="keyword", filters={"user_id": "ivy"})
        assert memory["id"] not in [r["id"] for r in swim]


def test_update_metadata_and_expiry_only(server):
    with server.client() as c:
        memory = add(c, "Jack's locker is number 12", user_id="jack", metadata={"v": 1})
        body = c.patch(f"/v1/memories/{memory['id']}", json={"metadata": {"v": 2}}).json()
        assert body["metadata"] == {"v": 2} and body["memory"] == "Jack's locker is number 12"
        results = search(c, "locker", filters={"user_id": "jack", "metadata.v": 2})
        assert [r["id"] for r in results] == [memory["id"]]


def test_history_records_add_update_delete_with_actor(server):
    with server.client() as c:
        memory = add(c, "Kim's cat is called Miso", user_id="kim")
        c.patch(f"/v1/memories/{memory['id']}", json={"text": "Kim's cat is called Tofu"})
        assert c.delete(f"/v1/memories/{memory['id']}").json() == {"deleted": 1}
        history = c.get(f"/v1/memories/{memory['id']}/history").json()["results"]
        assert [h["event"] for h in history] == ["ADD", "UPDATE", "DELETE"]
        assert history[0]["old_memory"] is None and history[0]["new_memory"] == "Kim's cat is called Miso"
        assert history[1]["old_memory"] == "Kim's cat is called Miso"
        assert history[1]["new_memory"] == "Kim's cat is called Tofu"
        assert history[2]["old_memory"] == "Kim's cat is called Tofu" and history[2]["new_memory"] is None
        keys = c.get("/v1/admin/keys").json()["results"]
        assert {h["actor"] for h in history} == {keys[0]["id"]}
        assert c.get(f"/v1/memories/{memory['id']}").status_code == 404
        assert search(c, "cat", filters={"user_id": "kim"}) == []


def test_delete_scope_removes_only_that_scope(server):
    with server.client() as c:
        for text in ("Leo grows carrots", "Leo repaired his bike", "Leo's sister is a pilot"):
            add(c, text, user_id="leo", run_id="r1")
        add(c, "Leo likes tulips", user_id="leo", run_id="r2")
        assert c.delete("/v1/memories", params={"user_id": "leo", "run_id": "r1"}).json() == {"deleted": 3}
        remaining = c.get("/v1/memories", params={"user_id": "leo"}).json()["results"]
        assert [m["memory"] for m in remaining] == ["Leo likes tulips"]


def test_list_paginates_newest_first_with_cursor(server):
    with server.client() as c:
        texts = ["Mia visited Paris", "Mia owns a parrot", "Mia studies chemistry", "Mia's brother is Tom",
                 "Mia runs marathons", "Mia dislikes olives", "Mia was born in Oslo"]
        for text in texts:
            add(c, text, user_id="mia")
        seen, cursor = [], None
        while True:
            params = {"user_id": "mia", "limit": 3, **({"cursor": cursor} if cursor else {})}
            page = c.get("/v1/memories", params=params).json()
            seen += [m["memory"] for m in page["results"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == list(reversed(texts))


FILTER_CASES = [
    ({"metadata.kind": "food"}, {"pizza", "ramen"}),
    ({"metadata.kind": {"ne": "food"}}, {"hiking", "chess"}),
    ({"metadata.rating": {"gte": 4}}, {"pizza", "hiking"}),
    ({"metadata.rating": {"lt": 4}}, {"ramen", "chess"}),
    ({"metadata.kind": {"in": ["sport", "game"]}}, {"hiking", "chess"}),
    ({"metadata.kind": {"nin": ["sport", "game"]}}, {"pizza", "ramen"}),
    ({"metadata.tags": {"contains": "outdoor"}}, {"hiking"}),
    ({"metadata.note": {"contains": "weekend"}}, {"chess", "hiking"}),
    ({"OR": [{"metadata.kind": "sport"}, {"metadata.rating": 1}]}, {"hiking", "chess"}),
    ({"NOT": [{"metadata.kind": "food"}]}, {"hiking", "chess"}),
    ({"AND": [{"metadata.kind": "food"}, {"metadata.rating": {"gt": 4}}]}, {"pizza"}),
    ({"metadata": {"kind": "game"}}, {"chess"}),
]


@pytest.mark.parametrize("filters,expected", FILTER_CASES, ids=[str(f) for f, _ in FILTER_CASES])
def test_metadata_filters(server, filters, expected):
    with server.client() as c:
        items = [
            ("Nora loves pizza", {"kind": "food", "rating": 5, "tags": ["italian"], "note": "any day"}),
            ("Nora eats ramen", {"kind": "food", "rating": 3, "tags": ["japanese"], "note": "cold days"}),
            ("Nora goes hiking", {"kind": "sport", "rating": 4, "tags": ["outdoor"], "note": "every weekend"}),
            ("Nora plays chess", {"kind": "game", "rating": 1, "tags": ["indoor"], "note": "weekend evenings"}),
        ]
        c.post("/v1/memories/batch", json={"items": [{"text": t, "user_id": "nora", "metadata": m} for t, m in items]})
        for mode in ("dense", "keyword", "hybrid"):
            results = search(c, "Nora pizza ramen hiking chess", mode=mode, top_k=10,
                             filters={"AND": [{"user_id": "nora"}, filters]})
            assert {r["memory"].split()[-1] for r in results} == expected


def test_created_at_range_filter(server):
    with server.client() as c:
        add(c, "Omar planted tomatoes", user_id="omar")
        time.sleep(0.05)
        middle = datetime.now(timezone.utc).isoformat()
        time.sleep(0.05)
        add(c, "Omar harvested tomatoes", user_id="omar")
        after = search(c, "tomatoes", filters={"user_id": "omar", "created_at": {"gt": middle}})
        before = search(c, "tomatoes", filters={"user_id": "omar", "created_at": {"lte": middle}})
        assert [r["memory"] for r in after] == ["Omar harvested tomatoes"]
        assert [r["memory"] for r in before] == ["Omar planted tomatoes"]


def test_scope_filters_on_agent_and_run(server):
    with server.client() as c:
        add(c, "Pia prefers tea", user_id="pia", agent_id="chef", run_id="r1")
        add(c, "Pia prefers green tea in the morning", user_id="pia", agent_id="coach", run_id="r2")
        by_agent = search(c, "tea", filters={"user_id": "pia", "agent_id": "coach"})
        by_run = search(c, "tea", filters={"run_id": "r1"})
        assert [r["agent_id"] for r in by_agent] == ["coach"]
        assert [r["run_id"] for r in by_run] == ["r1"]


def test_boolean_metadata_filters_match_on_every_backend(server):
    with server.client() as c:
        c.post("/v1/memories/batch", json={"items": [
            {"text": "Rex is a premium customer", "user_id": "rex", "metadata": {"vip": True}},
            {"text": "Rex asked about shipping costs", "user_id": "rex", "metadata": {"vip": False}},
        ]})
        vip = search(c, "customer", filters={"user_id": "rex", "metadata.vip": True})
        not_vip = search(c, "customer", filters={"user_id": "rex", "metadata.vip": {"ne": True}})
        assert [r["memory"] for r in vip] == ["Rex is a premium customer"]
        assert [r["memory"] for r in not_vip] == ["Rex asked about shipping costs"]
        assert vip[0]["metadata"] == {"vip": True}  # stored and returned as JSON booleans


def test_an_expired_memory_is_no_duplicate_of_a_new_one(runtime, admin):
    # No maintenance thread here, so the expired memory is still in the database and the index.
    from memory_server.schemas import AddRequest

    soon = datetime.now(timezone.utc) + timedelta(seconds=1)
    old = runtime.memories.add(admin, AddRequest(text="Jude lives in Lagos, Nigeria.", user_id="jude", expires_at=soon))
    time.sleep(1.2)
    exact = runtime.memories.add(admin, AddRequest(text="Jude lives in Lagos, Nigeria.", user_id="jude")).results[0]
    near = runtime.memories.add(admin, AddRequest(text="Jude lives in Lagos, Nigeria", user_id="jude")).results[0]
    assert exact.event == "ADD" and exact.id != old.results[0].id
    assert near.event == "NOOP" and near.id == exact.id  # a near duplicate of the live one only


def test_expired_copies_awaiting_the_sweep_do_not_hide_a_live_near_duplicate(runtime, admin):
    """A reviewer's finding (session 27): the near-duplicate check asked the index for the scope's 8
    closest points, expired ones included, and eight expired copies of a fact (re-noted by an
    agent each time the last one expired, not yet swept) pushed the live near-duplicate out: the
    fact was stored twice."""
    from memory_server.models import ChangeLogEntry, MemoryRecord, new_memory_ids
    from memory_server.schemas import AddRequest
    from memory_server.services.vector_memory import NEAR_CANDIDATES, text_hash

    text = "Quinn is working from the Lisbon office today"
    vector = runtime.embedder.embed([text])[0].tobytes()
    past = datetime.now(timezone.utc) - timedelta(minutes=1)
    rows = [{"id": memory_id, "tenant_id": admin.tenant_id, "user_id": "quinn", "agent_id": None, "run_id": None,
             "text": text, "context": None, "hash": text_hash(text), "metadata": {}, "embedding": vector,
             "created_at": past - timedelta(minutes=5), "updated_at": past - timedelta(minutes=5), "expires_at": past}
            for memory_id in new_memory_ids(NEAR_CANDIDATES)]
    with runtime.engine.begin() as connection:  # expired, and no maintenance thread here to sweep them
        connection.execute(MemoryRecord.__table__.insert(), rows)
        connection.execute(ChangeLogEntry.__table__.insert(), [
            {"tenant_id": admin.tenant_id, "memory_id": row["id"], "op": "upsert", "created_at": past} for row in rows])
    runtime.sync.catch_up()
    live = runtime.memories.add(admin, AddRequest(text=text + ".", user_id="quinn")).results[0]
    again = runtime.memories.add(admin, AddRequest(text=text, user_id="quinn")).results[0]
    assert live.event == "ADD"
    assert (again.event, again.id) == ("NOOP", live.id)


def test_an_add_committed_after_a_listing_began_never_shows_on_its_later_pages(runtime, admin, monkeypatch):
    """A reviewer's finding (session 27): an add's creation time was taken as it began, so a slow
    batch that began before quick adds committed after them with an earlier time, and a listing
    that read its first page in between met the batch on its second. The batch is held here just
    before the write lock, with its texts embedded, while the quick adds commit and page 1 is read."""
    import threading

    from memory_server.schemas import AddRequest

    for i in range(3):
        runtime.memories.add(admin, AddRequest(text=f"Lee's old note number {i}", user_id="lee"))
    held, release = hold_before_the_write_lock(monkeypatch, "slow-batch")
    batch = [AddRequest(text=f"Lee's batch entry about topic {i}", user_id="lee") for i in range(5)]
    slow = threading.Thread(target=runtime.memories.add_batch, args=(admin, batch), name="slow-batch")
    slow.start()
    assert held.wait(30)
    quick = [runtime.memories.add(admin, AddRequest(text=text, user_id="lee")).results[0].id
             for text in ("Lee flies to Oslo on Monday", "Lee's cat is called Miso", "Lee plays the cello")]
    first = runtime.memories.list(admin, user_id="lee", limit=2)
    assert [m.id for m in first.results] == quick[:0:-1]
    release.set()
    slow.join(30)
    rest = runtime.memories.list(admin, user_id="lee", limit=100, cursor=first.next_cursor)
    assert [m.memory for m in rest.results] == ["Lee flies to Oslo on Monday"] + [
        f"Lee's old note number {i}" for i in (2, 1, 0)]
    everything = runtime.memories.list(admin, user_id="lee", limit=100).results
    assert [m.memory for m in everything[:5]] == sorted((m.memory for m in everything[:5]), reverse=True) == [
        b.text for b in batch][::-1]  # the batch came last, so it lists first


def test_a_hit_that_expired_unseen_by_the_index_costs_no_result(runtime, admin):
    # The index leaves the expiry condition out of its query when it knows of no expired point. Should
    # one come back all the same (an old change applied between its answer and the check), the
    # search asks again with the condition: top_k results, none expired, as with the condition.
    from memory_server.schemas import AddRequest, SearchRequest

    soon = datetime.now(timezone.utc) + timedelta(seconds=1)
    expired = runtime.memories.add(admin, AddRequest(text="Kim's locker code is 5521", user_id="kim", expires_at=soon))
    for text in ("Kim keeps a spare locker key at home", "Kim's gym locker is number 12", "Kim bikes to work"):
        runtime.memories.add(admin, AddRequest(text=text, user_id="kim"))
    time.sleep(1.2)  # expired; no maintenance thread here, so it stays in the index
    request = SearchRequest(query="locker code", filters={"user_id": "kim"}, top_k=3)
    exact = runtime.memories.search(admin, request)
    runtime.index._earliest_expiry = float("inf")  # as if the index had not seen the expired point
    assert not runtime.index.may_hold_expired(time.time())
    unseen = runtime.memories.search(admin, request)
    assert [m.id for m in unseen] == [m.id for m in exact] and len(exact) == 3
    assert expired.results[0].id not in {m.id for m in exact}


@pytest.mark.parametrize("change", ["delete", "update", "delete_scope", "expire"])
def test_a_batch_never_answers_noop_to_a_memory_removed_while_it_embedded(runtime, admin, monkeypatch, change):
    """A race a review found (session 28): a batch's NOOPs are chosen before the write lock, and a
    scope delete committed meanwhile left the batch answering NOOP to memories that no longer
    existed (49 of 60 rounds): the facts the caller was told are stored were gone; so did one that
    expired meanwhile. The batch is held here just before the write lock while the stored memory is
    deleted, changed or expires."""
    from memory_server.schemas import AddRequest, SearchRequest, UpdateRequest

    expires_at = datetime.now(timezone.utc) + timedelta(seconds=1) if change == "expire" else None
    stored = runtime.memories.add(admin, AddRequest(text="Lee keeps bees on the roof", user_id="lee",
                                                    expires_at=expires_at)).results[0]
    batch = [AddRequest(text="Lee keeps bees on the roof", user_id="lee"),  # the stored one, exactly
             AddRequest(text="Lee keeps bees on the roof!", user_id="lee"),  # and nearly
             AddRequest(text="Lee keeps bees on the roof", user_id="lee"),  # the first again
             AddRequest(text="Lee plays chess on Sundays", user_id="lee")]

    def meanwhile():
        if change == "delete":
            runtime.memories.delete(admin, stored.id)
        elif change == "update":
            runtime.memories.update(admin, stored.id, UpdateRequest(text="Lee sold the bees"))
        elif change == "delete_scope":
            runtime.memories.delete_scope(admin, user_id="lee")
        else:  # expired, unswept: nothing is written (a review, session 29)
            time.sleep(max(0.0, (expires_at - datetime.now(timezone.utc)).total_seconds()) + 0.1)

    results = batch_held_before_the_write_lock(runtime, admin, monkeypatch, batch, meanwhile).results
    assert [r.event for r in results] == ["ADD", "NOOP", "NOOP", "ADD"]
    assert stored.id not in {r.id for r in results}
    assert results[1].id == results[2].id == results[0].id
    listed = {m.id: m.memory for m in runtime.memories.list(admin, user_id="lee", limit=100).results}
    assert listed[results[0].id] == "Lee keeps bees on the roof" and results[3].id in listed
    hits = runtime.memories.search(admin, SearchRequest(query="bees", filters={"user_id": "lee"}, mode="keyword"))
    assert results[0].id in {h.id for h in hits}


@pytest.mark.parametrize("change", ["delete", "update"])
def test_a_fact_whose_noop_target_went_while_it_embedded_is_a_noop_to_another_stored_copy(
        runtime, admin, monkeypatch, change):
    """A review's leftover (session 29): a fact answered NOOP to a stored memory that was deleted or
    changed while the add embedded was then checked only against the request's own new memories,
    so a second stored memory holding it in other words (made by an update, which has no dedup)
    got a copy beside it. It is a NOOP to that one now; the lost target is never the answer."""
    import numpy as np

    from memory_server.schemas import AddRequest, UpdateRequest

    texts = ["Lee keeps bees on the roof", "Lee keeps bees up on the roof", "Lee keeps bees on the roof!"]
    first, second, fact = runtime.embedder.embed(texts)
    threshold = runtime.settings.dedup_threshold
    assert np.dot(fact, first) > np.dot(fact, second) >= threshold  # the first is the NOOP target
    target = runtime.memories.add(admin, AddRequest(text=texts[0], user_id="lee")).results[0]
    other = runtime.memories.add(admin, AddRequest(text="Lee owns a red kayak", user_id="lee")).results[0]
    runtime.memories.update(admin, other.id, UpdateRequest(text=texts[1]))
    batch = [AddRequest(text=texts[2], user_id="lee"), AddRequest(text="Lee plays chess on Sundays", user_id="lee")]

    def meanwhile():
        if change == "delete":
            runtime.memories.delete(admin, target.id)
        else:
            runtime.memories.update(admin, target.id, UpdateRequest(text="Lee sold the bees"))

    results = batch_held_before_the_write_lock(runtime, admin, monkeypatch, batch, meanwhile).results
    assert [(r.event, r.id, r.memory) for r in results[:1]] == [("NOOP", other.id, texts[1])]
    assert results[1].event == "ADD"
    listed = sorted(m.memory for m in runtime.memories.list(admin, user_id="lee", limit=100).results)
    assert listed == sorted([texts[1], "Lee plays chess on Sundays"] + (["Lee sold the bees"] if change == "update" else []))


def batch_held_before_the_write_lock(runtime, admin, monkeypatch, batch, meanwhile):
    """The answer of a batch add held just before its write lock while `meanwhile()` runs."""
    import threading

    held, release = hold_before_the_write_lock(monkeypatch, "slow-batch")
    answers = []
    slow = threading.Thread(target=lambda: answers.append(runtime.memories.add_batch(admin, batch)), name="slow-batch")
    slow.start()
    assert held.wait(30)
    try:
        meanwhile()
    finally:
        release.set()
        slow.join(30)
    return answers[0]


def hold_before_the_write_lock(monkeypatch, thread_name: str):
    """(held, release): an add running in the thread named `thread_name` sets `held` once its texts
    are embedded and its checks done, just before it takes the write lock, and waits for `release`."""
    import threading

    from memory_server.services import vector_memory

    held, release = threading.Event(), threading.Event()
    real_begin_write = vector_memory.begin_write

    def begin_write(connection):
        if threading.current_thread().name == thread_name:
            held.set()
            release.wait(30)
        real_begin_write(connection)

    monkeypatch.setattr(vector_memory, "begin_write", begin_write)
    return held, release
