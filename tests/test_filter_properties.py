"""Search filters mean what docs/vector-memory.md says, whatever their shape: hypothesis builds
random filter trees (AND / OR / NOT, every operator, missing keys, mixed value types, nested keys)
and a dense search with each must return exactly the memories a plain-Python reading of the
documented rules selects, on both index backends."""


import hypothesis
import pytest
from hypothesis import strategies as st

from conftest import make_settings
from memory_server.auth import Principal
from memory_server.runtime import Runtime
from memory_server.schemas import AddRequest, SearchRequest

BACKENDS = {"edge": None, "qdrant": ":memory:"}
MISSING = object()

# The metadata of the scope's memories: each key missing from some of them, "code" a string in some
# and a number in others, "score" whole in some ("3.0" equals 3), "tags" a list.
TOPICS = ["tea", "travel", "garden", "Tea", "teapot"]
METADATA = []
for i in range(40):
    meta = {}
    if i % 5:
        meta["topic"] = TOPICS[i % len(TOPICS)]
    if i % 3:
        meta["n"] = i % 7
    if i % 4 != 1:
        meta["score"] = [0.5, 1.0, 2.25, 3.0, 3][i % 5]
    if i % 6:
        meta["vip"] = bool(i % 2)
    if i % 7 != 3:
        meta["code"] = ["A7", 7, "7", "B2", 2][i % 5]
    if i % 2:
        meta["tags"] = [["drink", "tea"], ["drinks"], [], ["garden", "tea", "x"]][i // 2 % 4]
    if i % 3 != 2:
        meta["owner"] = {"name": ["Anna", "Bo", "anna"][i % 3]}
    METADATA.append(meta)
AGENTS = [None, "a1", "a2"]

STRINGS = st.sampled_from(["tea", "travel", "garden", "Tea", "teapot", "A7", "7", "B2", "Anna", "anna", "Bo",
                           "drink", "x", "zzz"])
INTEGERS = st.integers(-1, 8)
NUMBERS = st.one_of(INTEGERS, st.sampled_from([0.5, 1.0, 2.25, 3.0, 2.5, -0.5]))
EQUALITY_KEYS = ["topic", "n", "score", "vip", "code", "owner.name", "tags"]


def _value_for(key):
    if key == "vip":
        return st.booleans()
    if key in ("n", "score"):
        return NUMBERS
    if key == "code":
        return st.one_of(STRINGS, INTEGERS)
    return STRINGS


def _leaves():
    eq = st.sampled_from(EQUALITY_KEYS).flatmap(lambda k: _value_for(k).map(lambda v: (k, v)))
    in_lists = st.one_of(
        st.tuples(st.sampled_from(["topic", "code", "owner.name", "tags"]), st.lists(STRINGS, min_size=1, max_size=3)),
        st.tuples(st.sampled_from(["n", "code", "score"]), st.lists(INTEGERS, min_size=1, max_size=3)))
    ranges = st.tuples(st.sampled_from(["n", "score"]), st.sampled_from(["gt", "gte", "lt", "lte"]), NUMBERS)
    contains = st.tuples(st.sampled_from(["tags", "topic", "owner.name"]),
                         st.sampled_from(["tea", "drink", "dri", "ea", "Tea", "x", "nn", "zzz"]))
    return st.one_of(
        eq.map(lambda kv: {f"metadata.{kv[0]}": kv[1]}),
        eq.map(lambda kv: {"metadata": {kv[0]: kv[1]}} if "." not in kv[0] else {f"metadata.{kv[0]}": {"eq": kv[1]}}),
        eq.map(lambda kv: {f"metadata.{kv[0]}": {"ne": kv[1]}}),
        in_lists.map(lambda kv: {f"metadata.{kv[0]}": {"in": kv[1]}}),
        in_lists.map(lambda kv: {f"metadata.{kv[0]}": {"nin": kv[1]}}),
        ranges.map(lambda r: {f"metadata.{r[0]}": {r[1]: r[2]}}),
        st.tuples(ranges, ranges).filter(lambda rr: rr[0][0] == rr[1][0] and rr[0][1] != rr[1][1])
          .map(lambda rr: {f"metadata.{rr[0][0]}": {rr[0][1]: rr[0][2], rr[1][1]: rr[1][2]}}),
        contains.map(lambda kv: {f"metadata.{kv[0]}": {"contains": kv[1]}}),
        st.sampled_from(["a1", "a2", "a3"]).map(lambda a: {"agent_id": a}),
        st.sampled_from(["a1", "a2"]).map(lambda a: {"agent_id": {"ne": a}}),
        st.lists(st.sampled_from(["a1", "a2", "a3"]), min_size=1, max_size=2).map(lambda a: {"agent_id": {"nin": a}}),
    )


FILTERS = st.recursive(_leaves(), lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(lambda items: {"AND": items}),
    st.lists(inner, min_size=1, max_size=3).map(lambda items: {"OR": items}),
    inner.map(lambda item: {"NOT": item}),
    st.lists(inner, min_size=1, max_size=2).map(lambda items: {"NOT": items}),
), max_leaves=6)


# -- the documented rules, in plain Python ---------------------------------------------------------
def _get(memory: dict, key: str):
    if key == "agent_id":
        return memory["agent_id"] if memory["agent_id"] is not None else MISSING
    value = memory["metadata"]
    for part in key[len("metadata."):].split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(stored, wanted) -> bool:
    """Strings exactly; numbers by their exact value (3 == 3.0, 2^53 + 1 != 2^53), booleans as 1 and
    0 (true == 1 == 1.0); a string never equals a number."""
    stored, wanted = (int(v) if isinstance(v, bool) else v for v in (stored, wanted))
    if _is_number(stored) and _is_number(wanted):
        return stored == wanted  # Python compares an int with a float exactly
    return isinstance(stored, str) and isinstance(wanted, str) and stored == wanted


def _operator(stored, op: str, operand) -> bool:
    present = stored is not MISSING
    values = stored if isinstance(stored, list) else [stored]  # a list: any element
    if op in ("eq", "ne"):
        equal = present and any(_equal(value, operand) for value in values)
        return equal if op == "eq" else not equal
    if op in ("in", "nin"):
        found = present and any(_equal(value, v) for value in values for v in operand)
        return found if op == "in" else not found
    if op == "contains":
        texts = stored if isinstance(stored, list) else [stored]
        return any(isinstance(text, str) and operand in text for text in texts)
    compare = {"gt": float.__gt__, "gte": float.__ge__, "lt": float.__lt__, "lte": float.__le__}[op]
    return present and _is_number(stored) and compare(float(stored), float(operand))  # as float64, as indexed


def matches(memory: dict, filters: dict) -> bool:
    for key, value in filters.items():
        if key == "AND":
            ok = all(matches(memory, item) for item in value)
        elif key == "OR":
            ok = any(matches(memory, item) for item in value)
        elif key == "NOT":
            ok = not any(matches(memory, item) for item in (value if isinstance(value, list) else [value]))
        elif key == "metadata":
            ok = all(_operator(_get(memory, f"metadata.{k}"), "eq", v) for k, v in value.items())
        elif isinstance(value, dict):
            ok = all(_operator(_get(memory, key), op, operand) for op, operand in value.items())
        else:
            ok = _operator(_get(memory, key), "eq", value)
        if not ok:
            return False
    return True


# -- the service ----------------------------------------------------------------------------------
ADMIN = Principal(tenant_id="t1", key_id="key_test_admin", role="admin")


@pytest.fixture(scope="module", params=list(BACKENDS))
def loaded(request, tmp_path_factory, embedder):
    runtime = Runtime.open(make_settings(tmp_path_factory.mktemp(request.param), qdrant_url=BACKENDS[request.param]),
                           embedder=embedder)
    memories = []
    for user in ("u", "v"):  # "v" holds the same metadata: a filter must never reach past its scope
        items = [AddRequest(text=f"note {i} of {user}", user_id=user, agent_id=AGENTS[i % 3], metadata=meta)
                 for i, meta in enumerate(METADATA)]
        ids = [r.id for r in runtime.memories.add_batch(ADMIN, items).results]
        memories += [{"id": i, "user_id": user, "agent_id": item.agent_id, "metadata": item.metadata}
                     for i, item in zip(ids, items)]
    yield runtime, memories
    runtime.close()


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(filters=FILTERS)
def test_a_filtered_search_returns_exactly_the_memories_the_documented_rules_select(loaded, filters):
    runtime, memories = loaded
    wanted = {m["id"] for m in memories if m["user_id"] == "u" and matches(m, filters)}
    hits = runtime.memories.search(ADMIN, SearchRequest(query="note", filters={"user_id": "u", "AND": [filters]},
                                                        mode="dense", top_k=100))
    assert {h.id for h in hits} == wanted, filters


def test_an_integer_matches_a_stored_whole_float_and_a_huge_integer_only_itself(loaded):
    runtime, memories = loaded

    def found(filters):
        hits = runtime.memories.search(ADMIN, SearchRequest(query="note", filters={"user_id": "u", **filters},
                                                            mode="dense", top_k=100))
        return {h.id for h in hits}

    whole = {m["id"] for m in memories if m["user_id"] == "u" and m["metadata"].get("score") == 3}
    assert {type(m["metadata"]["score"]) for m in memories if m["id"] in whole} == {int, float}  # 3 and 3.0
    assert found({"metadata.score": 3}) == found({"metadata.score": 3.0}) == found({"metadata.score": {"in": [3]}}) == whole
    # Past 2^53 a float stands for several integers: there only the integer itself matches.
    added = runtime.memories.add_batch(ADMIN, [AddRequest(text=f"big {n}", user_id="w", metadata={"big": n})
                                               for n in (2**53, 2**53 + 1)])
    big = {r.memory: r.id for r in added.results}
    hits = runtime.memories.search(ADMIN, SearchRequest(query="big", filters={"user_id": "w", "metadata.big": 2**53 + 1},
                                                        mode="dense", top_k=10))
    assert [h.id for h in hits] == [big[f"big {2**53 + 1}"]]


def _found(runtime, user: str, filters: dict) -> set[str]:
    hits = runtime.memories.search(ADMIN, SearchRequest(query="note", filters={"user_id": user, **filters},
                                                        mode="dense", top_k=100))
    return {h.id for h in hits}


def test_true_equals_a_stored_1_and_1_0_as_1_does(loaded):
    """Booleans are indexed as 1 and 0, and 3 equals 3.0: so true, 1 and 1.0 select the same memories."""
    runtime, _ = loaded
    values = [True, 1, 1.0, False, 0, 0.0, -0.0, 2, "1", "true"]
    added = runtime.memories.add_batch(ADMIN, [AddRequest(text=f"note flag {v!r}", user_id="flags", metadata={"flag": v})
                                               for k, v in enumerate(values)])
    ids = [r.id for r in added.results]

    def having(*wanted):
        return {i for i, v in zip(ids, values) if any(type(v) is type(w) and v == w for w in wanted)}

    ones, zeros = having(True, 1, 1.0), having(False, 0, 0.0)
    for operand in (True, 1, 1.0):
        assert _found(runtime, "flags", {"metadata.flag": operand}) == ones, operand
        assert _found(runtime, "flags", {"metadata.flag": {"ne": operand}}) == set(ids) - ones, operand
    for operand in (False, 0, 0.0, -0.0):
        assert _found(runtime, "flags", {"metadata.flag": operand}) == zeros, operand
    assert _found(runtime, "flags", {"metadata.flag": {"in": [1]}}) == ones
    assert _found(runtime, "flags", {"metadata.flag": {"nin": [0, 2]}}) == set(ids) - zeros - having(2)


def test_equality_at_2_53_and_beyond_matches_the_integer_itself_on_both_indexes(loaded):
    """`eq 2^53` also matched a stored 2^53 + 1 on Qdrant Edge: its float alternative, [2^53, 2^53],
    holds every integer that rounds to 2^53 there (a reviewer's finding, session 27)."""
    runtime, _ = loaded
    values = (2**53 - 1, 2**53, 2**53 + 1, 2**53 + 2, 2**63 - 1, -(2**53), -(2**53) - 1)
    added = runtime.memories.add_batch(ADMIN, [AddRequest(text=f"note huge {k}", user_id="huge", metadata={"i": v})
                                               for k, v in enumerate(values)])
    ids = dict(zip(values, (r.id for r in added.results)))
    for v in values:
        assert _found(runtime, "huge", {"metadata.i": v}) == {ids[v]}, v
        assert _found(runtime, "huge", {"metadata.i": {"in": [v, 7]}}) == {ids[v]}, v
        assert _found(runtime, "huge", {"metadata.i": {"ne": v}}) == set(ids.values()) - {ids[v]}, v
        assert _found(runtime, "huge", {"metadata.i": {"nin": [v]}}) == set(ids.values()) - {ids[v]}, v


def test_a_scoped_search_condition_reaches_the_index_as_one_flat_filter():
    # The tenant's and key's restrictions wrap the request's condition three Alls deep; the
    # index gets one filter of leaves (each nested filter cost the Edge binding ~8 leaves), and
    # an OR or a NOT only where the request has one.
    from memory_server.services.filters import restrict
    from memory_server.storage.vectors.filters import All, Any_, Field, Not, flatten

    key = Principal(tenant_id="t1", key_id="k", role="agent", user_ids=("anna",))
    scoped = restrict(key, All((All((Field("user_id", "eq", "anna"),)),)))
    assert flatten(scoped) == ([Field("tenant", "eq", "t1"), Field("user_id", "in", ("anna",)),
                                Field("user_id", "eq", "anna")], None, [])
    either = Any_((Field("topic", "eq", "tea"), Field("n", "gt", 2)))
    unlike = Not(Field("vip", "eq", True))
    nested = All((scoped, All((either, unlike, Any_((Field("n", "lt", 1), Field("n", "gt", 5)))))))
    assert flatten(nested) == (
        [*flatten(scoped).must, Any_((Field("n", "lt", 1), Field("n", "gt", 5)))], list(either.items), [unlike.item])
    assert flatten(either) == ([], list(either.items), []) and flatten(unlike) == ([], None, [unlike.item])
    assert flatten(Any_(())) == ([], [], []) and flatten(All((Any_(()),))) == ([Any_(())], None, [])
