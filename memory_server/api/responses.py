"""The error JSON of API.md as responses, shared by FastAPI's exception handlers and the direct routes."""

from fastapi.responses import JSONResponse

from memory_server.errors import MemoryServerError


def error_response(status: int, code: str, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "field": field}}, status_code=status)


def domain_error_response(exc: MemoryServerError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.field)


def validation_error_response(errors: list) -> JSONResponse:
    """400 for a body that is not JSON, else 422 naming the first field pydantic refused (`errors`
    as pydantic reports them, their `loc` relative to the body)."""
    first = errors[0]
    location = [f"[{p}]" if isinstance(p, int) else str(p) for p in first.get("loc", ())]
    field = ".".join(location).replace(".[", "[") or None
    if first.get("type") == "json_invalid":
        return error_response(400, "malformed_json", "request body is not valid JSON", None)
    if first.get("type") == "missing" and not location:
        return error_response(422, "invalid_input", "request body is required", None)
    message = first.get("msg", "invalid input")
    return error_response(422, "invalid_input", f"{field}: {message}" if field else message, field)


def internal_error_response() -> JSONResponse:
    return error_response(500, "internal_error", "internal error; see the server log")
