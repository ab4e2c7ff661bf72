"""Vector memory routes (API.md, section Vector memory).

Routes are `async def` and hand the blocking service call to the thread pool themselves with
`in_thread` (see memory_server/api/deps.py for why). Add, batch add and search are the hot ones:
memory_server/api/direct.py answers them ahead of FastAPI with the same calls (`DIRECT`).

A search's query and a single add's texts go to the model as the request arrives, right after its
checks, on the event loop, and a request thread is taken only once the vectors are back (stage
`embed`): a model call gathers the texts of every request waiting in the worker, not only of those
that have a request thread, and no request thread sits waiting for the model, so a few request
threads serve many clients (bench/analysis.md, round 29).
"""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from memory_server.api.deps import MemoriesDep, PrincipalDep
from memory_server.api.responses import documented_errors
from memory_server.auth import Principal
from memory_server.errors import InvalidInput
from memory_server.schemas import (
    SCOPE_ID_PATTERN, AddRequest, AddResponse, BatchAddRequest, DeleteResponse, HistoryResponse, MemoryOut,
    MemoryPage, SearchRequest, SearchResponse, UpdateRequest,
)
from memory_server.services.vector_memory import VectorMemory
from memory_server.timing import awaited, in_thread

router = APIRouter(prefix="/v1/memories", tags=["vector memory"],
                   responses=documented_errors(400, 401, 403, 413, 422, 503))
ONE_MEMORY = documented_errors(404)  # the routes of one memory by id
ScopeQuery = Annotated[str | None, Query(pattern=SCOPE_ID_PATTERN)]


def _each_parameter_once(request: Request) -> None:
    """`?user_id=a&user_id=b` names two scopes: refused, rather than listing or deleting one of them."""
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise InvalidInput(f"{name} is given more than once", field=name)


ONCE = [Depends(_each_parameter_once)]


async def _add(memories: VectorMemory, principal: Principal, body: AddRequest) -> AddResponse:
    ahead = memories.add_ahead(principal, body)  # checked, and its texts handed to the model now
    await awaited("embed", ahead.vectors)  # a request thread is taken once they are embedded
    return await in_thread(memories.add, principal, body, ahead)


async def _add_batch(memories: VectorMemory, principal: Principal, body: BatchAddRequest) -> AddResponse:
    return await in_thread(memories.add_batch, principal, body.items)


async def _search(memories: VectorMemory, principal: Principal, body: SearchRequest) -> SearchResponse:
    ahead = memories.search_ahead(principal, body)  # checked, and its query handed to the model now
    await awaited("embed", ahead.query_vector)
    return SearchResponse(results=await in_thread(memories.search, principal, body, ahead))


@router.post("", response_model=AddResponse)
async def add_memory(body: AddRequest, principal: PrincipalDep, memories: MemoriesDep) -> AddResponse:
    return await _add(memories, principal, body)


@router.post("/batch", response_model=AddResponse)
async def add_memories(body: BatchAddRequest, principal: PrincipalDep, memories: MemoriesDep) -> AddResponse:
    return await _add_batch(memories, principal, body)


@router.post("/search", response_model=SearchResponse)
async def search_memories(body: SearchRequest, principal: PrincipalDep, memories: MemoriesDep) -> SearchResponse:
    return await _search(memories, principal, body)


# Routes memory_server/api/direct.py answers ahead of FastAPI: each route and the call that answers it.
DIRECT = ((add_memory, _add), (add_memories, _add_batch), (search_memories, _search))


@router.get("", response_model=MemoryPage, dependencies=ONCE)
async def list_memories(principal: PrincipalDep, memories: MemoriesDep, user_id: ScopeQuery = None,
                        agent_id: ScopeQuery = None, run_id: ScopeQuery = None,
                        limit: Annotated[int, Query(ge=1, le=200)] = 100,
                        cursor: Annotated[str | None, Query(max_length=512)] = None) -> MemoryPage:
    return await in_thread(memories.list, principal, user_id=user_id, agent_id=agent_id, run_id=run_id,
                           limit=limit, cursor=cursor)


@router.delete("", response_model=DeleteResponse, dependencies=ONCE)
async def delete_scope(principal: PrincipalDep, memories: MemoriesDep, user_id: ScopeQuery = None,
                       agent_id: ScopeQuery = None, run_id: ScopeQuery = None) -> DeleteResponse:
    deleted = await in_thread(memories.delete_scope, principal, user_id=user_id, agent_id=agent_id,
                              run_id=run_id)
    return DeleteResponse(deleted=deleted)


@router.get("/{memory_id}", response_model=MemoryOut, responses=ONE_MEMORY)
async def get_memory(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> MemoryOut:
    return await in_thread(memories.get, principal, memory_id)


@router.patch("/{memory_id}", response_model=MemoryOut, responses=ONE_MEMORY)
async def update_memory(memory_id: str, body: UpdateRequest, principal: PrincipalDep,
                        memories: MemoriesDep) -> MemoryOut:
    return await in_thread(memories.update, principal, memory_id, body)


@router.delete("/{memory_id}", response_model=DeleteResponse, responses=ONE_MEMORY)
async def delete_memory(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> DeleteResponse:
    return DeleteResponse(deleted=await in_thread(memories.delete, principal, memory_id))


@router.get("/{memory_id}/history", response_model=HistoryResponse, responses=ONE_MEMORY)
async def memory_history(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> HistoryResponse:
    return HistoryResponse(results=await in_thread(memories.history, principal, memory_id))
