"""Request and response models of the public HTTP API (field names follow mem0's)."""

import math
import re
import unicodedata
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, StringConstraints, WithJsonSchema
from pydantic_core import PydanticCustomError

from memory_server.errors import InvalidInput

SCOPE_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
_SCOPE_ID = re.compile(SCOPE_ID_PATTERN)

ScopeId = Annotated[str, StringConstraints(pattern=SCOPE_ID_PATTERN)]


def validate_scope_id(value: str, field: str) -> str:
    # fullmatch: the pattern's `$` also matches before a final newline ("bob\n" was a key's user id).
    if not isinstance(value, str) or not _SCOPE_ID.fullmatch(value):
        raise InvalidInput(f"{field} must be 1-128 characters of A-Z a-z 0-9 . _ : @ -", field=field)
    return value


# The one grammar of times in requests (bodies and filters alike): an ISO 8601 date-time with an
# optional zone (none = UTC), or a date alone (midnight UTC, as mem0's expiration_date is written).
# Numbers and digit strings are refused: pydantic's lax mode read them as Unix seconds ("20991231"
# was 1970-08-31), while an ISO 8601 reader reads "20991231" as a date.
_ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}(?:[Tt ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:[Zz]|[+-]\d{2}:?\d{2})?)?")
TIME_FORMS = ("an ISO 8601 time such as 2099-12-31T23:59:59Z (no zone = UTC) or a date such as 2099-12-31 "
              "(midnight UTC)")


def parse_time(value: Any) -> datetime:
    """A request's time as an aware UTC datetime; otherwise ValueError, whose message completes
    "<field> ..." ("should be an ISO 8601 time ...")."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str) and _ISO_TIME.fullmatch(value):
        try:
            moment = datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        except ValueError as exc:  # a day or hour that does not exist
            raise ValueError(f"should be {TIME_FORMS}: {value!r} is not a valid time ({exc})") from None
    elif isinstance(value, str):
        raise ValueError(f"should be {TIME_FORMS}, not {value!r}")
    else:
        kind = ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
                else "null" if value is None else f"a JSON {'list' if isinstance(value, list) else 'object'}")
        raise ValueError(f"should be {TIME_FORMS} (a string), not {kind}")
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError(f"is out of range once converted to UTC ({value!r})") from None


def _request_time(value: Any) -> datetime:
    try:
        return parse_time(value)
    except ValueError as exc:  # pydantic would prefix a plain ValueError's message with "Value error, "
        raise PydanticCustomError("time_parsing", "Input {reason}", {"reason": str(exc)}) from None


UtcDatetime = Annotated[datetime, PlainValidator(_request_time), WithJsonSchema({
    "anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}],
    "description": "ISO 8601: a date-time (no zone = UTC) or a date (midnight UTC); not a number"})]

INT64 = (-(2**63), 2**63 - 1)


def is_unicode(text: str) -> bool:
    """False for a string no store can hold: JSON's `\\ud800` escape alone (a surrogate that is
    not half of a pair) decodes to one, and UTF-8 has no encoding for it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _unicode_text(value: str) -> str:
    if not is_unicode(value):
        raise ValueError("text must be valid Unicode (it holds a lone surrogate such as \\ud800)")
    return value


# Free text: every string that is stored or compared is valid Unicode (schemas.is_unicode).
UnicodeText = Annotated[str, AfterValidator(_unicode_text)]


def is_line_break_or_control(character: str) -> bool:
    """Tab, newline and other control characters (NUL too), and Unicode's line and paragraph separators."""
    return unicodedata.category(character) in ("Cc", "Zl", "Zp")


def _one_line(value: str) -> str:
    """A name shown or matched as one line: a key's label (`keys list` prints one tab-separated line
    per key), a message's role (kept in the memory's metadata, where NUL is refused)."""
    if not is_unicode(value):
        raise PydanticCustomError("one_line", "must be valid Unicode (it holds a lone surrogate such as \\ud800)")
    if any(is_line_break_or_control(c) for c in value):
        raise PydanticCustomError("one_line", "must not contain control characters (NUL, tab, newline, …) or line "
                                  "separators")
    return value


def check_json_values(value: Any, depth: int = 0) -> Any:
    """Metadata must fit every store: integers in 64 bits, finite numbers (JSON has no NaN or
    Infinity; PostgreSQL refuses them), valid Unicode without NUL characters (PostgreSQL refuses
    NUL, no store takes a lone surrogate), nesting at most 8 levels."""
    if depth > 8:
        raise ValueError("metadata is nested too deeply (8 levels at most)")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise ValueError("metadata integers must fit in 64 bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("metadata numbers must be finite (NaN and Infinity are not JSON)")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("metadata strings must not contain NUL characters")
        if not is_unicode(value):
            raise ValueError("metadata strings must be valid Unicode (a lone surrogate such as \\ud800 is not)")
    if isinstance(value, dict):
        for key, item in value.items():
            check_json_values(key, depth + 1)
            check_json_values(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            check_json_values(item, depth + 1)
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(check_json_values)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(BaseModel):
    role: Annotated[str, StringConstraints(min_length=1, max_length=32), AfterValidator(_one_line)]
    content: UnicodeText
    name: UnicodeText | None = None
    metadata: "Metadata | None" = None  # merged over the add's metadata for this message's memory


Message.model_rebuild()


class AddRequest(BaseModel):
    """One add: `messages` (each non-system message becomes a memory) or `text`."""

    # The document says "one of the two" (the service says "exactly one", with a 422).
    model_config = ConfigDict(extra="ignore", json_schema_extra={"anyOf": [{"required": ["text"]},
                                                                           {"required": ["messages"]}]})

    messages: list[Message] | None = None
    text: UnicodeText | None = None
    user_id: ScopeId | None = None
    agent_id: ScopeId | None = None
    run_id: ScopeId | None = None
    metadata: Metadata | None = None
    expires_at: UtcDatetime | None = None
    infer: bool = Field(False, strict=True)


class BatchAddRequest(BaseModel):
    items: list[AddRequest] = Field(min_length=1)


class AddResult(BaseModel):
    id: str
    memory: str
    event: Literal["ADD", "UPDATE", "NOOP"]


class AddResponse(BaseModel):
    results: list[AddResult]
    warnings: list[str] = Field(default_factory=list)


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    filters: dict[str, Any] | None = None
    # Strict: a number is a JSON number, as the OpenAPI document says ("10", true and 2.5 are refused,
    # not read as 10, 1.0 and 2).
    top_k: int = Field(10, ge=1, le=100, strict=True)
    threshold: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    mode: Literal["hybrid", "dense", "keyword"] = "hybrid"
    # mem0 OSS style: scope ids at the top level are ANDed into `filters`.
    user_id: ScopeId | None = None
    agent_id: ScopeId | None = None
    run_id: ScopeId | None = None


class UpdateRequest(_Strict):
    text: UnicodeText | None = None
    metadata: Metadata | None = None
    expires_at: UtcDatetime | None = None


class MemoryOut(BaseModel):
    id: str
    memory: str
    user_id: str | None
    agent_id: str | None
    run_id: str | None
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    hash: str


class ScoredMemory(MemoryOut):
    score: float


class SearchResponse(BaseModel):
    results: list[ScoredMemory]


class MemoryPage(BaseModel):
    results: list[MemoryOut]
    next_cursor: str | None


class DeleteResponse(BaseModel):
    deleted: int


class HistoryEntry(BaseModel):
    event: Literal["ADD", "UPDATE", "DELETE"]
    old_memory: str | None
    new_memory: str | None
    actor: str
    created_at: datetime


class HistoryResponse(BaseModel):
    results: list[HistoryEntry]


# The ids a key may be restricted to: they go into SQL as one parameter each (PostgreSQL takes at
# most 65,535 a statement), and into every search's filter.
MAX_KEY_IDS = 1000


class KeyCreate(_Strict):
    role: Literal["admin", "agent"]
    user_ids: list[ScopeId] = Field(default_factory=list, max_length=MAX_KEY_IDS)
    agent_ids: list[ScopeId] = Field(default_factory=list, max_length=MAX_KEY_IDS)
    label: Annotated[str, StringConstraints(max_length=200), AfterValidator(_one_line)] | None = None


class KeyPublic(BaseModel):
    id: str
    tenant_id: str
    role: str
    user_ids: list[str]
    agent_ids: list[str]
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyPublic):
    key: str


class KeyList(BaseModel):
    results: list[KeyPublic]


class ErrorDetail(BaseModel):
    code: str = Field(description="snake_case, stable: what a program branches on")
    message: str = Field(description="for people")
    field: str | None = Field(None, description="the request field at fault, as a path (`items[3].text`)")


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer (API.md, Conventions)."""
    error: ErrorDetail


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    checks: dict[str, bool]
