"""Request dependencies as Annotated aliases.

They are `async def` on purpose: FastAPI runs every plain `def` dependency in the thread pool,
one hop (and GIL hand-over) each per request. Only a key that is not cached touches the database,
and that lookup goes to the thread pool.

Routes are `async def` too, and pass their blocking service call to the thread pool themselves
(`timing.in_thread`, which also times the wait for a thread): for a plain `def` route FastAPI
also validates the returned model in the thread pool, a second hop that under load queues for a
thread behind every request waiting for its first.
"""

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader
from sqlmodel import Session

from memory_server.auth import Principal, parse_authorization, verify_key
from memory_server.runtime import Runtime
from memory_server.services.vector_memory import VectorMemory
from memory_server.timing import in_thread


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


# The OpenAPI document's security scheme (so /docs has an "Authorize" button); the header's value
# is the whole `Bearer <key>` or `Token <key>`, checked by principal_for (a missing one is a 401 there).
API_KEY = APIKeyHeader(name="Authorization", scheme_name="APIKey", auto_error=False,
                       description="`Bearer <key>` (or mem0's `Token <key>`)")


# Where the front layer that verifies every /v1/ request's key before its body is read (app.py
# KeyFirst) leaves the principal for the route.
PRINCIPAL = "memory_server.principal"


async def get_principal(request: Request, runtime: RuntimeDep,
                        authorization: Annotated[str | None, Depends(API_KEY)]) -> Principal:
    return request.scope.get(PRINCIPAL) or await principal_for(runtime, authorization)


async def principal_for(runtime: Runtime, authorization: str | None) -> Principal:
    """The principal of an Authorization header's key: from the key cache, or verified in a request thread."""
    key = parse_authorization(authorization)
    generation = runtime.keys.generation  # before the database read: see KeyCache.put
    return runtime.keys.peek(key) or runtime.keys.put(key, await in_thread(_verify, runtime, key), generation)


def _verify(runtime: Runtime, key: str) -> Principal:
    with Session(runtime.engine) as session:
        return verify_key(session, key)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_memories(runtime: RuntimeDep) -> VectorMemory:
    return runtime.memories


MemoriesDep = Annotated[VectorMemory, Depends(get_memories)]
