"""API key management for unrestricted admin keys, bounded to the admin's own tenant."""

from fastapi import APIRouter
from sqlmodel import Session

from memory_server.api.deps import PrincipalDep, RuntimeDep
from memory_server.api.responses import documented_errors
from memory_server.auth import Principal, create_key, list_keys, record_revocation, revoke_key
from memory_server.runtime import Runtime
from memory_server.schemas import KeyCreate, KeyCreated, KeyList, KeyPublic
from memory_server.timing import in_thread

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"], responses=documented_errors(400, 401, 403, 413, 422, 503))


@router.post("", response_model=KeyCreated, status_code=201)
async def create_api_key(body: KeyCreate, principal: PrincipalDep, runtime: RuntimeDep) -> KeyCreated:
    principal.require_key_manager()
    return await in_thread(_create, runtime, principal, body)


def _create(runtime: Runtime, principal: Principal, body: KeyCreate) -> KeyCreated:
    with Session(runtime.engine) as session:
        row, plaintext = create_key(session, tenant_id=principal.tenant_id, role=body.role, user_ids=body.user_ids,
                                    agent_ids=body.agent_ids, label=body.label)
        return KeyCreated(**KeyPublic.model_validate(row, from_attributes=True).model_dump(), key=plaintext)


@router.get("", response_model=KeyList)
async def list_api_keys(principal: PrincipalDep, runtime: RuntimeDep) -> KeyList:
    principal.require_key_manager()
    return await in_thread(_list, runtime, principal)


def _list(runtime: Runtime, principal: Principal) -> KeyList:
    with Session(runtime.engine) as session:
        rows = list_keys(session, principal.tenant_id)
        return KeyList(results=[KeyPublic.model_validate(r, from_attributes=True) for r in rows])


@router.delete("/{key_id}", response_model=KeyPublic, responses=documented_errors(404))
async def revoke_api_key(key_id: str, principal: PrincipalDep, runtime: RuntimeDep) -> KeyPublic:
    principal.require_key_manager()
    revoked = await in_thread(_revoke, runtime, principal, key_id)
    runtime.keys.clear()
    record_revocation(runtime.settings.data_dir, key_id)  # the other workers on this data directory
    return revoked


def _revoke(runtime: Runtime, principal: Principal, key_id: str) -> KeyPublic:
    with Session(runtime.engine) as session:
        return KeyPublic.model_validate(revoke_key(session, key_id, principal.tenant_id), from_attributes=True)
