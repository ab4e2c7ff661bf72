"""Random sequences of adds, batch adds, updates, deletes and scope deletes, checked after every step
against a plain model of what the store should hold: what get, list, search and history answer,
and that the vector index holds exactly the live memories (hypothesis' stateful testing, on every
database the suite runs and both index backends)."""

import uuid

import hypothesis
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from conftest import make_settings
from memory_server.auth import Principal
from memory_server.errors import NotFound
from memory_server.runtime import Runtime
from memory_server.schemas import AddRequest, SearchRequest, UpdateRequest

# Every text has numbers of its own: two different texts are never near-duplicates (a near-duplicate
# must carry the same numbers), so only an exact repeat in the same scope is a NOOP.
TEXTS = st.integers(0, 11).map(lambda k: f"Parcel {k} waits on shelf {100 + k}")
USERS = st.sampled_from(["u1", "u2"])
METADATA = st.one_of(st.none(), st.fixed_dictionaries({"k": st.integers(0, 3)}))


class MemoryLifecycle(RuleBasedStateMachine):
    memories = Bundle("memories")

    def __init__(self, runtime):
        super().__init__()
        self.service = runtime.memories
        # A tenant of its own: every run starts from an empty store on the shared runtime.
        self.principal = Principal(tenant_id=f"t-{uuid.uuid4().hex[:8]}", key_id="key_lifecycle", role="admin")
        self.live: dict[str, dict] = {}  # id -> {"text", "user", "metadata"}
        self.events: dict[str, list[tuple]] = {}  # id -> [(event, old, new)]

    def _same_text(self, user: str, text: str) -> set[str]:
        return {i for i, m in self.live.items() if m["user"] == user and m["text"] == text}

    def _added(self, result, user: str, text: str, metadata) -> str:
        existing = self._same_text(user, text)
        if existing:  # the memory already held, as stored
            assert result.event == "NOOP" and result.id in existing, (result, existing)
        else:
            assert result.event == "ADD" and result.id not in self.events
            self.live[result.id] = {"text": text, "user": user, "metadata": metadata or {}}
            self.events[result.id] = [("ADD", None, text)]
        return result.id

    @rule(target=memories, text=TEXTS, user=USERS, metadata=METADATA)
    def add(self, text, user, metadata):
        response = self.service.add(self.principal, AddRequest(text=text, user_id=user, metadata=metadata))
        (result,) = response.results
        return self._added(result, user, text, metadata)

    @rule(items=st.lists(st.tuples(TEXTS, USERS), min_size=1, max_size=4))
    def add_batch(self, items):
        response = self.service.add_batch(self.principal, [AddRequest(text=t, user_id=u) for t, u in items])
        assert len(response.results) == len(items)
        for result, (text, user) in zip(response.results, items):
            self._added(result, user, text, None)

    @rule(memory=memories, text=st.one_of(st.none(), TEXTS), metadata=METADATA)
    def update(self, memory, text, metadata):
        fields = {"text": text} if text is not None else {"metadata": metadata}
        if memory not in self.live:
            try:
                self.service.update(self.principal, memory, UpdateRequest(**fields))
            except NotFound:
                return
            raise AssertionError(f"updated deleted memory {memory}")
        out = self.service.update(self.principal, memory, UpdateRequest(**fields))
        model = self.live[memory]
        old = model["text"]
        if text is not None:
            model["text"] = text
        else:
            model["metadata"] = metadata or {}
        self.events[memory].append(("UPDATE", old, model["text"]))
        assert (out.memory, out.metadata) == (model["text"], model["metadata"])

    @rule(memory=consumes(memories))
    def delete(self, memory):
        if memory in self.live:
            assert self.service.delete(self.principal, memory) == 1
            self.events[memory].append(("DELETE", self.live.pop(memory)["text"], None))
        else:
            try:
                self.service.delete(self.principal, memory)
            except NotFound:
                return
            raise AssertionError(f"deleted memory {memory} twice")

    @rule(user=USERS)
    def delete_user(self, user):
        gone = [i for i, m in self.live.items() if m["user"] == user]
        assert self.service.delete_scope(self.principal, user_id=user) == len(gone)
        for memory in gone:
            self.events[memory].append(("DELETE", self.live.pop(memory)["text"], None))

    @invariant()
    def get_list_and_search_answer_as_the_model(self):
        for user in ("u1", "u2"):
            wanted = {i: (m["text"], m["metadata"]) for i, m in self.live.items() if m["user"] == user}
            page = self.service.list(self.principal, user_id=user, limit=200)
            assert {m.id: (m.memory, m.metadata) for m in page.results} == wanted
            assert page.next_cursor is None
            # Pages of 3 give the same memories in the same order (newest first), each once.
            paged, cursor = [], None
            while True:
                small = self.service.list(self.principal, user_id=user, limit=3, cursor=cursor)
                paged += [m.id for m in small.results]
                if small.next_cursor is None:
                    break
                cursor = small.next_cursor
            assert paged == [m.id for m in page.results]
            # The index holds exactly the live memories: a dense search ranks every point of the scope.
            hits = self.service.search(self.principal, SearchRequest(query="parcel on a shelf", user_id=user,
                                                                     mode="dense", top_k=100))
            assert {h.id: (h.memory, h.metadata) for h in hits} == wanted
        for memory, model in self.live.items():
            got = self.service.get(self.principal, memory)
            assert (got.memory, got.user_id, got.metadata) == (model["text"], model["user"], model["metadata"])

    @invariant()
    def history_tells_every_change_in_order(self):
        for memory, events in self.events.items():
            history = self.service.history(self.principal, memory)
            assert [(h.event, h.old_memory, h.new_memory) for h in history] == events


@pytest.mark.parametrize("qdrant_url", [None, ":memory:"], ids=["edge", "qdrant"])
def test_random_lifecycles_keep_sql_index_and_history_in_step(tmp_path, database_url, embedder, qdrant_url):
    runtime = Runtime.open(make_settings(tmp_path / "data", database_url, qdrant_url), embedder=embedder)
    try:
        hypothesis.stateful.run_state_machine_as_test(
            lambda: MemoryLifecycle(runtime),
            settings=hypothesis.settings(max_examples=25, stateful_step_count=20, deadline=None, derandomize=True,
                                         suppress_health_check=list(hypothesis.HealthCheck)))
    finally:
        runtime.close()
