"""API keys (stored hashed, shown once) and the Principal a verified key stands for."""

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sqlmodel import Session, select

from memory_server.errors import Forbidden, InvalidInput, NotFound, Unauthorized, quoted_id
from memory_server.models import ApiKey, utcnow
from memory_server.storage.shared_word import SharedWord

Role = Literal["admin", "agent"]
ROLES = ("admin", "agent")
KEY_PREFIX = "msk_"
KEY_ID_PREFIX = "key_"
_KEY_ID = re.compile(KEY_ID_PREFIX + "[0-9a-f]{16}")
log = logging.getLogger("memory_server")
# The tenant of the bootstrap admin key: the server's operator, who sees what spans every tenant (/metrics).
OPERATOR_TENANT = "default"


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

    @property
    def is_restricted(self) -> bool:
        return bool(self.user_ids or self.agent_ids)

    def require_admin(self) -> None:
        if not self.is_admin:
            raise Forbidden("this operation needs an admin key")

    def require_key_manager(self) -> None:
        """Keys are managed by unrestricted admin keys only: a key restricted to some users or
        agents could otherwise make itself an unrestricted one, or revoke the keys of others."""
        self.require_admin()
        if self.is_restricted:
            raise Forbidden("managing keys needs an admin key that is not restricted to some user_ids or agent_ids")

    def require_operator(self) -> None:
        """What covers every tenant (the server's metrics) is for the operator's unrestricted admin keys."""
        self.require_admin()
        if self.tenant_id != OPERATOR_TENANT or self.is_restricted:
            raise Forbidden(f"this covers every tenant: it needs an unrestricted admin key of the operator's tenant "
                            f"('{OPERATOR_TENANT}', the bootstrap key's)")

    def allowed(self, kind: str) -> tuple[str, ...]:
        """The values a restricted key may touch for `user_id`/`agent_id`; empty = unrestricted."""
        return {"user_id": self.user_ids, "agent_id": self.agent_ids}.get(kind, ())

    def check_value(self, kind: str, value: str | None, field_prefix: str = "") -> None:
        allowed = self.allowed(kind)
        if allowed and value is not None and value not in allowed:
            raise Forbidden(f"this key may not access {kind} '{value}'", field=field_prefix + kind)

    def resolve_write_scope(self, user_id: str | None, agent_id: str | None,
                            field_prefix: str = "") -> tuple[str | None, str | None]:
        """Fill in the key's own id when it is restricted to exactly one, and refuse any other
        (`field_prefix` places the field in the request: `items[3].`)."""
        resolved = []
        for kind, value in (("user_id", user_id), ("agent_id", agent_id)):
            allowed = self.allowed(kind)
            if allowed and value is None:
                if len(allowed) > 1:
                    raise Forbidden(f"this key is restricted to several {kind}s; name one", field=field_prefix + kind)
                value = allowed[0]
            self.check_value(kind, value, field_prefix)
            resolved.append(value)
        return resolved[0], resolved[1]

    def can_see(self, user_id: str | None, agent_id: str | None) -> bool:
        return all(not allowed or value in allowed
                   for allowed, value in ((self.user_ids, user_id), (self.agent_ids, agent_id)))


class KeyCache:
    """Verified keys for a few seconds, so a request does not need a database round trip to
    authenticate. Failed lookups are never cached.

    A revocation appends a line to the data directory's revocation file (`revocations`: the server's
    API and the CLI both do) and adds one to the revocation count beside it (`revocations-count`, a
    SharedWord), and every lookup first compares that count with the one it last saw (~0.2 µs, no
    system call): so a revocation takes effect at once in every process on that data directory (all
    workers of `serve --workers N`), and on replicas elsewhere within `ttl` seconds. The file itself
    is `stat`ed at most every `stat_seconds` (its size, modification time and inode), for a change
    the count does not show: the file replaced, truncated or removed, or a line appended by an
    earlier version. (Every lookup `stat`ed it until round 42 of bench/analysis.md: the call lets go
    of the interpreter's lock, and under load the event loop waited to get it back.) Where the count
    cannot be mapped, every lookup `stat`s the file, as before.

    A key verified while a revocation happened is not cached (`generation`), so a request that read
    the key just before the revocation committed cannot put it back for another `ttl`."""

    def __init__(self, ttl: float, revocations: Path | None = None, stat_seconds: float = 1.0):
        self.ttl = ttl
        self.revocations = revocations
        self._count = (SharedWord.open(revocation_count_path(revocations), "every request stats the revocation file")
                       if revocations is not None else None)
        self._stat_seconds = stat_seconds if self._count is not None else 0.0
        self._seen = self._revocations_state()
        self._stat_due = time.monotonic() + self._stat_seconds
        self.generation = 0  # moves on every clear: a verification that spans one is not cached
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def _revocations_state(self) -> tuple[int, int, int, int]:
        """(revocation count, the file's size, modification time, inode); a missing file's size is -1."""
        try:
            found = os.stat(self.revocations) if self.revocations else None
        except FileNotFoundError:
            found = None
        count = self._count.read() if self._count is not None else 0
        return (count, found.st_size, found.st_mtime_ns, found.st_ino) if found else (count, -1, 0, 0)

    def _revoked_since_seen(self, now: float) -> bool:
        if self.revocations is None:
            return False
        if self._count is not None and self._count.read() != self._seen[0]:
            return True
        if now < self._stat_due:
            return False
        self._stat_due = now + self._stat_seconds
        return self._revocations_state() != self._seen

    def peek(self, key: str) -> Principal | None:
        """The cached principal for a key, or None when it must be verified."""
        now = time.monotonic()
        if self._revoked_since_seen(now):
            self.clear()
        with self._lock:
            hit = self._entries.get(hash_key(key))
        return hit[1] if hit and hit[0] > now else None

    def put(self, key: str, principal: Principal, generation: int) -> Principal:
        """Cache a principal verified since `generation` (read before the verification began)."""
        if self.ttl > 0:
            with self._lock:
                if generation != self.generation:
                    return principal  # a revocation came in meanwhile: verify again next time
                if len(self._entries) > 10_000:
                    self._entries.clear()
                self._entries[hash_key(key)] = (time.monotonic() + self.ttl, principal)
        return principal

    def clear(self) -> None:
        with self._lock:
            self._seen = self._revocations_state()
            self.generation += 1
            self._entries.clear()

    def close(self) -> None:
        if self._count is not None:
            self._count.close()
            self._count = None


REVOCATIONS_FILE = "revocations"


def revocation_count_path(revocations: Path) -> Path:
    return revocations.with_name(revocations.name + "-count")


def record_revocation(data_dir: Path, key_id: str) -> bool:
    """Tell every process on this data directory that a key was revoked (see KeyCache): one line
    appended to the revocation file (O_APPEND: writers never overwrite each other, and the file
    only grows), then one added to the revocation count. The key is revoked in the database either
    way. When the file cannot be written (made by another user, say), the error is logged, other
    processes refuse the key within their cache's lifetime, and this returns False; when only the
    count cannot, they refuse it within a second (their `stat` of the file)."""
    file = data_dir / REVOCATIONS_FILE
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{utcnow().isoformat()} {key_id}\n".encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.error("key %s is revoked, but %s could not be written (%s): other server processes on this data "
                  "directory refuse it only once their key cache expires", key_id, file, exc.strerror or exc)
        return False
    count = SharedWord.open(revocation_count_path(file), "other processes on this data directory see a revocation "
                                                        "within a second, when they next stat the revocation file")
    if count is not None:
        try:
            count.add(1)
        except OSError as exc:
            log.warning("cannot add to %s (%s): other processes on this data directory see the revocation within "
                        "a second", count.path, exc.strerror or exc)
        finally:
            count.close()
    return True


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
    key_id = KEY_ID_PREFIX + secrets.token_hex(8)
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
    # Only an id of the form keys are given is looked up: PostgreSQL refuses a NUL in a text
    # parameter with an error (a 500), where "no such key" is the answer.
    row = session.get(ApiKey, key_id) if _KEY_ID.fullmatch(key_id) else None
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFound(f"no key '{quoted_id(key_id)}'")
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
