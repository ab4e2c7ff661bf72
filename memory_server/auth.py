"""API keys (stored hashed, shown once) and the Principal a verified key stands for."""

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from sqlmodel import Session, select

from memory_server.errors import Forbidden, InvalidInput, NotFound, Unauthorized
from memory_server.models import ApiKey, utcnow

Role = Literal["admin", "agent"]
ROLES = ("admin", "agent")
KEY_PREFIX = "msk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: always derived from a verified key, never from the request body."""

    tenant_id: str
    key_id: str
    role: Role
    user_ids: tuple[str, ...] = field(default_factory=tuple)
    agent_ids: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def require_admin(self) -> None:
        if not self.is_admin:
            raise Forbidden("this operation needs an admin key")

    def allowed(self, kind: str) -> tuple[str, ...]:
        """The values a restricted key may touch for `user_id`/`agent_id`; empty = unrestricted."""
        return {"user_id": self.user_ids, "agent_id": self.agent_ids}.get(kind, ())

    def check_value(self, kind: str, value: str | None) -> None:
        allowed = self.allowed(kind)
        if allowed and value is not None and value not in allowed:
            raise Forbidden(f"this key may not access {kind} '{value}'", field=kind)

    def resolve_write_scope(self, user_id: str | None, agent_id: str | None) -> tuple[str | None, str | None]:
        """Fill in the key's own id when it is restricted to exactly one, and refuse any other."""
        resolved = []
        for kind, value in (("user_id", user_id), ("agent_id", agent_id)):
            allowed = self.allowed(kind)
            if allowed and value is None:
                if len(allowed) > 1:
                    raise Forbidden(f"this key is restricted to several {kind}s; name one", field=kind)
                value = allowed[0]
            self.check_value(kind, value)
            resolved.append(value)
        return resolved[0], resolved[1]

    def can_see(self, user_id: str | None, agent_id: str | None) -> bool:
        return all(not allowed or value in allowed
                   for allowed, value in ((self.user_ids, user_id), (self.agent_ids, agent_id)))


class KeyCache:
    """Verified keys for a few seconds, so a request does not need a database round trip to
    authenticate. A revocation through this server clears it at once; one made elsewhere (the CLI,
    another replica) takes effect within `ttl` seconds. Failed lookups are never cached."""

    def __init__(self, ttl: float):
        self.ttl = ttl
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, verify) -> Principal:
        return self.peek(key) or self.put(key, verify())

    def peek(self, key: str) -> Principal | None:
        """The cached principal for a key, or None when it must be verified."""
        with self._lock:
            hit = self._entries.get(hash_key(key))
        return hit[1] if hit and hit[0] > time.monotonic() else None

    def put(self, key: str, principal: Principal) -> Principal:
        if self.ttl > 0:
            with self._lock:
                if len(self._entries) > 10_000:
                    self._entries.clear()
                self._entries[hash_key(key)] = (time.monotonic() + self.ttl, principal)
        return principal

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def hash_key(key: str) -> str:
    # Keys carry 256 bits of randomness, so a fast hash is enough; no salt or KDF is needed.
    return hashlib.sha256(key.encode()).hexdigest()


def _principal(row: ApiKey) -> Principal:
    return Principal(row.tenant_id, row.id, row.role, tuple(row.user_ids), tuple(row.agent_ids))


def create_key(session: Session, *, tenant_id: str, role: str, user_ids: list[str] | None = None,
               agent_ids: list[str] | None = None, label: str | None = None) -> tuple[ApiKey, str]:
    """Returns the stored row and the plaintext key (the only time it exists)."""
    from memory_server.schemas import MAX_KEY_IDS, validate_scope_id

    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}", field="role")
    validate_scope_id(tenant_id, "tenant")
    for kind, values in (("user_ids", user_ids or []), ("agent_ids", agent_ids or [])):
        if len(set(values)) > MAX_KEY_IDS:
            raise InvalidInput(f"a key may be restricted to at most {MAX_KEY_IDS} {kind}", field=kind)
        for value in values:
            validate_scope_id(value, kind)
    key_id = "key_" + secrets.token_hex(8)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id=key_id, tenant_id=tenant_id, role=role, key_hash=hash_key(plaintext),
                 user_ids=sorted(set(user_ids or [])), agent_ids=sorted(set(agent_ids or [])), label=label,
                 created_at=utcnow())
    session.add(row)
    session.commit()
    session.refresh(row)
    return row, plaintext


def verify_key(session: Session, plaintext: str) -> Principal:
    row = session.exec(select(ApiKey).where(ApiKey.key_hash == hash_key(plaintext))).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key")
    return _principal(row)


def list_keys(session: Session, tenant_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(session.exec(query))


def revoke_key(session: Session, key_id: str, tenant_id: str | None = None) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFound(f"no key '{key_id}'")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        session.commit()
        session.refresh(row)
    return row


def parse_authorization(header: str | None) -> str:
    if not header:
        raise Unauthorized("missing Authorization header (use 'Bearer <key>' or 'Token <key>')")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("bearer", "token") or not token.strip():
        raise Unauthorized("Authorization must be 'Bearer <key>' or 'Token <key>'")
    return token.strip()
