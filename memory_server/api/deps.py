"""Request dependencies as Annotated aliases."""

from typing import Annotated

from fastapi import Depends, Header, Request
from sqlmodel import Session

from memory_server.auth import Principal, parse_authorization, verify_key
from memory_server.runtime import Runtime
from memory_server.services.vector_memory import VectorMemory


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_principal(runtime: RuntimeDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    key = parse_authorization(authorization)
    return runtime.keys.get(key, lambda: _verify(runtime, key))


def _verify(runtime: Runtime, key: str) -> Principal:
    with Session(runtime.engine) as session:
        return verify_key(session, key)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_memories(runtime: RuntimeDep) -> VectorMemory:
    return runtime.memories


MemoriesDep = Annotated[VectorMemory, Depends(get_memories)]
