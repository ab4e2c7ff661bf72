"""One exception tree for the service and the table that maps it to HTTP statuses."""


class MemoryServerError(Exception):
    """Base: carries the error JSON fields of API.md."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code:
            self.code = code

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}


def quoted_id(value: str) -> str:
    """An id as an error message repeats it: a long one (a path of any length) cut short."""
    return value if len(value) <= 64 else value[:64] + "…"


class BadRequest(MemoryServerError):
    status, code = 400, "bad_request"


class InvalidInput(MemoryServerError):
    status, code = 422, "invalid_input"


class Unauthorized(MemoryServerError):
    status, code = 401, "unauthorized"


class Forbidden(MemoryServerError):
    status, code = 403, "forbidden"


class NotFound(MemoryServerError):
    status, code = 404, "not_found"


class Conflict(MemoryServerError):
    status, code = 409, "conflict"


class PayloadTooLarge(MemoryServerError):
    status, code = 413, "payload_too_large"


class Unavailable(MemoryServerError):
    status, code = 503, "unavailable"


class StartupError(RuntimeError):
    """Configuration or stored state that makes it unsafe to start (e.g. a dimension mismatch)."""
