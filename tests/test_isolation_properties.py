"""No filter reaches past the key: for random key restrictions and random filter trees (scope ids
anywhere in them, under OR and NOT too), a search either is refused (403 / 422) or returns exactly
the memories of the key's tenant that the key may see and the filter selects; a listing and a read
by id never show another tenant's or another user's memory."""

import hypothesis
import pytest
from hypothesis import strategies as st

from conftest import make_settings
from memory_server.auth import Principal
from memory_server.errors import Forbidden, InvalidInput, NotFound
from memory_server.runtime import Runtime
from memory_server.schemas import AddRequest, SearchRequest
from test_filter_properties import _leaves, matches

USERS = ["u1", "u2", "u3"]
AGENTS = ["a1", "a2"]
ADMIN = {tenant: Principal(tenant_id=tenant, key_id=f"key_{tenant}", role="admin") for tenant in ("t1", "t2")}

SCOPE_LEAVES = st.one_of(
    st.sampled_from(USERS).map(lambda u: {"user_id": u}),
    st.lists(st.sampled_from(USERS), min_size=1, max_size=2).map(lambda us: {"user_id": {"in": us}}),
    st.sampled_from(USERS).map(lambda u: {"user_id": {"ne": u}}),
    st.sampled_from(AGENTS).map(lambda a: {"agent_id": a}),
)
FILTERS = st.recursive(st.one_of(SCOPE_LEAVES, _leaves()), lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(lambda items: {"AND": items}),
    st.lists(inner, min_size=1, max_size=3).map(lambda items: {"OR": items}),
    inner.map(lambda item: {"NOT": item}),
), max_leaves=5)
KEYS = st.builds(lambda users, agents: Principal(tenant_id="t1", key_id="key_agent", role="agent",
                                                 user_ids=tuple(users), agent_ids=tuple(agents)),
                 st.lists(st.sampled_from(USERS), unique=True, max_size=2),
                 st.lists(st.sampled_from(AGENTS), unique=True, max_size=1))


@pytest.fixture(scope="module")
def store(tmp_path_factory, embedder):
    runtime = Runtime.open(make_settings(tmp_path_factory.mktemp("isolation")), embedder=embedder)
    memories = []
    for tenant in ("t1", "t2"):  # the same memories in both tenants
        items = [AddRequest(text=f"note {i} of {user} by {agent}", user_id=user, agent_id=agent,
                            metadata={"topic": ["tea", "travel"][i % 2], "n": i})
                 for i, (user, agent) in enumerate((u, a) for u in USERS for a in (*AGENTS, None))]
        for result, item in zip(runtime.memories.add_batch(ADMIN[tenant], items).results, items):
            memories.append({"id": result.id, "tenant": tenant, "user_id": item.user_id,
                             "agent_id": item.agent_id, "metadata": item.metadata})
    yield runtime, memories
    runtime.close()


def _scope_matches(memory: dict, filters: dict) -> bool:
    """matches() of test_filter_properties, with user_id conditions too."""
    plain = {}
    for key, value in filters.items():
        if key in ("AND", "OR"):
            ok = (all if key == "AND" else any)(_scope_matches(memory, item) for item in value)
        elif key == "NOT":
            ok = not _scope_matches(memory, value)
        elif key == "user_id":
            ok = (memory["user_id"] in value["in"] if isinstance(value, dict) and "in" in value
                  else memory["user_id"] != value["ne"] if isinstance(value, dict) else memory["user_id"] == value)
        else:
            plain[key] = value
            continue
        if not ok:
            return False
    return matches(memory, plain) if plain else True


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(key=KEYS, filters=FILTERS)
def test_a_search_returns_only_what_the_key_may_see_and_the_filter_selects(store, key, filters):
    runtime, memories = store
    try:
        hits = runtime.memories.search(key, SearchRequest(query="note", filters=filters, mode="dense", top_k=100))
    except (Forbidden, InvalidInput):
        return  # refused: names an id the key may not touch, or confines nothing
    seen = {m["id"] for m in memories if m["tenant"] == "t1" and key.can_see(m["user_id"], m["agent_id"])
            and _scope_matches(m, filters)}
    assert {h.id for h in hits} == seen


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(key=KEYS, user=st.sampled_from([None, *USERS]))
def test_a_listing_and_reads_by_id_show_only_what_the_key_may_see(store, key, user):
    runtime, memories = store
    visible = {m["id"] for m in memories if m["tenant"] == "t1" and key.can_see(m["user_id"], m["agent_id"])}
    try:
        page = runtime.memories.list(key, user_id=user, limit=200)
    except Forbidden:
        assert user is not None and key.user_ids and user not in key.user_ids
        return
    assert {m.id for m in page.results} == {i for i in visible if user is None or
                                            next(m for m in memories if m["id"] == i)["user_id"] == user}
    for memory in memories:
        if memory["id"] in visible:
            assert runtime.memories.get(key, memory["id"]).id == memory["id"]
        else:
            with pytest.raises(NotFound):
                runtime.memories.get(key, memory["id"])
