"""The error JSON of API.md as responses, shared by FastAPI's exception handlers and the direct routes."""

import json
import logging

from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from memory_server.errors import MemoryServerError, Unavailable
from memory_server.schemas import ErrorResponse

_MEANINGS = {
    400: "the body is not JSON, or a cursor or request is malformed",
    401: "no key, an unknown key or a revoked key",
    403: "the key may not do this (an agent key on an admin route, a user or agent outside its restriction)",
    404: "no such thing in the key's tenant (and scope)",
    413: "the body is over the size limit",
    422: "a field is invalid; `field` names it",
    503: "the database is unavailable (the request was not completed), or a change was saved but the vector "
         "index could not apply it yet (it is, once the index recovers)",
}


def documented_errors(*statuses: int) -> dict:
    """OpenAPI `responses` for these statuses, each with the error JSON, for a router or a route."""
    return {status: {"model": ErrorResponse, "description": _MEANINGS[status]} for status in statuses}


class _ErrorJSON(JSONResponse):
    def render(self, content) -> bytes:
        # ASCII with escapes: a message or field may quote what the request sent, and that can hold a
        # lone surrogate (JSON's "\\ud800"), which has no UTF-8 encoding.
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(status: int, code: str, message: str, field: str | None = None, *,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSON({"error": {"code": code, "message": message, "field": field}}, status_code=status,
                      headers=headers)


def domain_error_response(exc: MemoryServerError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.field)


def validation_error_response(errors: list) -> JSONResponse:
    """400 for a body that is not JSON, 422 for one not sent as JSON, else 422 naming the first field
    pydantic refused (`errors` as pydantic reports them, their `loc` relative to the body)."""
    first = errors[0]
    location = [f"[{p}]" if isinstance(p, int) else str(p) for p in first.get("loc", ())]
    field = ".".join(location).replace(".[", "[") or None
    if first.get("type") == "json_invalid":
        return error_response(400, "malformed_json", "request body is not valid JSON", None)
    if first.get("type") == "missing" and not location:
        return error_response(422, "invalid_input", "request body is required", None)
    if not location and isinstance(first.get("input"), (bytes, bytearray)):
        # A body not declared as JSON is validated as its bytes (FastAPI's rule, which the direct
        # routes follow): `curl -d` without -H sends application/x-www-form-urlencoded.
        return error_response(422, "invalid_input", "the body must be JSON sent with Content-Type: application/json "
                              "(or another application/*+json type)", None)
    message = first.get("msg", "invalid input")
    return error_response(422, "invalid_input", f"{field}: {message}" if field else message, field)


log = logging.getLogger("memory_server")

# The database did not answer: down, restarting, refusing connections, every pooled connection
# busy for the pool's timeout, or SQLite's lock held past its busy timeout. A request that meets
# one is not completed (its transaction is rolled back, or, if the connection broke while it
# committed, may have been committed: a retried add then finds its memory as an exact duplicate).
DATABASE_UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeout)


def caused_by_outage(exc: BaseException) -> bool:
    """Whether another database error was caused by the database going away: SQLAlchemy's pre-ping on
    PostgreSQL, its socket closed mid-ping (psycopg's OperationalError), then failed to restore
    autocommit and raised a ProgrammingError instead (a 500 in an outage test). The driver's own
    classes are PEP 249's, named alike in psycopg and sqlite3; SQL run on the driver's cursor
    (storage/db.py driver_rows) raises them unwrapped, subclasses such as psycopg's AdminShutdown (a
    backend terminated) included."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DATABASE_UNAVAILABLE) or any(
                kind.__name__ in ("OperationalError", "InterfaceError") for kind in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def database_unavailable_response(exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", str(exc).splitlines()[0])
    return domain_error_response(Unavailable("the database is unavailable; the request was not completed, retry later"))


def internal_error_response() -> JSONResponse:
    return error_response(500, "internal_error", "internal error; see the server log")


def response_for_error(exc: Exception) -> JSONResponse:
    """The answer to an exception raised outside FastAPI's handlers (the plain ASGI layers in front of
    it): a domain error's own status, 503 for a database outage (or an error one caused), else a
    logged 500."""
    if isinstance(exc, MemoryServerError):
        return domain_error_response(exc)
    if caused_by_outage(exc):
        return database_unavailable_response(exc)
    log.error("unhandled error", exc_info=exc)
    return internal_error_response()
