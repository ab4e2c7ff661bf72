"""Request dependencies as Annotated aliases.

They are `async def` on purpose: FastAPI runs every plain `def` dependency in the thread pool,
one hop (and GIL hand-over) each per request. Only a key that is not cached touches the database,
and that lookup goes to the thread pool.
"""

from typing import Annotated

from fastapi import Depends, Header, Request
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from memory_server.auth import Principal, parse_authorization, verify_key
from memory_server.runtime import Runtime
from memory_server.services.vector_memory import VectorMemory


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_principal(runtime: RuntimeDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    key = parse_authorization(authorization)
    return runtime.keys.peek(key) or runtime.keys.put(key, await run_in_threadpool(_verify, runtime, key))


def _verify(runtime: Runtime, key: str) -> Principal:
    with Session(runtime.engine) as session:
        return verify_key(session, key)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_memories(runtime: RuntimeDep) -> VectorMemory:
    return runtime.memories


MemoriesDep = Annotated[VectorMemory, Depends(get_memories)]
