"""Vector memory routes (API.md, section Vector memory)."""

from typing import Annotated

from fastapi import APIRouter, Query

from memory_server.api.deps import MemoriesDep, PrincipalDep
from memory_server.schemas import (
    SCOPE_ID_PATTERN, AddRequest, AddResponse, BatchAddRequest, DeleteResponse, HistoryResponse, MemoryOut,
    MemoryPage, SearchRequest, SearchResponse, UpdateRequest,
)

router = APIRouter(prefix="/v1/memories", tags=["vector memory"])
ScopeQuery = Annotated[str | None, Query(pattern=SCOPE_ID_PATTERN)]


@router.post("", response_model=AddResponse)
def add_memory(body: AddRequest, principal: PrincipalDep, memories: MemoriesDep) -> AddResponse:
    return memories.add(principal, body)


@router.post("/batch", response_model=AddResponse)
def add_memories(body: BatchAddRequest, principal: PrincipalDep, memories: MemoriesDep) -> AddResponse:
    return memories.add_batch(principal, body.items)


@router.post("/search", response_model=SearchResponse)
def search_memories(body: SearchRequest, principal: PrincipalDep, memories: MemoriesDep) -> SearchResponse:
    return SearchResponse(results=memories.search(principal, body))


@router.get("", response_model=MemoryPage)
def list_memories(principal: PrincipalDep, memories: MemoriesDep, user_id: ScopeQuery = None,
                  agent_id: ScopeQuery = None, run_id: ScopeQuery = None,
                  limit: Annotated[int, Query(ge=1, le=200)] = 100,
                  cursor: Annotated[str | None, Query(max_length=512)] = None) -> MemoryPage:
    return memories.list(principal, user_id=user_id, agent_id=agent_id, run_id=run_id, limit=limit, cursor=cursor)


@router.delete("", response_model=DeleteResponse)
def delete_scope(principal: PrincipalDep, memories: MemoriesDep, user_id: ScopeQuery = None,
                 agent_id: ScopeQuery = None, run_id: ScopeQuery = None) -> DeleteResponse:
    return DeleteResponse(deleted=memories.delete_scope(principal, user_id=user_id, agent_id=agent_id, run_id=run_id))


@router.get("/{memory_id}", response_model=MemoryOut)
def get_memory(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> MemoryOut:
    return memories.get(principal, memory_id)


@router.patch("/{memory_id}", response_model=MemoryOut)
def update_memory(memory_id: str, body: UpdateRequest, principal: PrincipalDep, memories: MemoriesDep) -> MemoryOut:
    return memories.update(principal, memory_id, body)


@router.delete("/{memory_id}", response_model=DeleteResponse)
def delete_memory(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> DeleteResponse:
    return DeleteResponse(deleted=memories.delete(principal, memory_id))


@router.get("/{memory_id}/history", response_model=HistoryResponse)
def memory_history(memory_id: str, principal: PrincipalDep, memories: MemoriesDep) -> HistoryResponse:
    return HistoryResponse(results=memories.history(principal, memory_id))
