"""Parse the API's `filters` JSON into the backend-neutral filter tree, naming the bad field."""

import re
from typing import Any

from memory_server.auth import Principal
from memory_server.errors import Forbidden, InvalidInput
from memory_server.schemas import check_json_values, parse_time, validate_scope_id
from memory_server.storage.vectors.filters import All, Any_, Condition, Field, Not, walk_fields

SCOPE_FIELDS = ("user_id", "agent_id", "run_id")
TIME_FIELDS = ("created_at", "updated_at", "expires_at")
OPERATORS = ("eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "contains")
RANGE_OPS = ("gt", "gte", "lt", "lte")
LOGICAL = {"AND": "AND", "OR": "OR", "NOT": "NOT", "and": "AND", "or": "OR", "not": "NOT"}
# Matched whole (`fullmatch`): `$` also matches before a final newline, and "topic\n" got through to
# Qdrant, which refused it with a 500.
_METADATA_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,3}")
NEVER = 253402300799.0  # 9999-12-31: the payload's expires_at for memories that never expire


def to_epoch(value: Any, field: str) -> float:
    """A filter's time, read exactly as a request body's `expires_at` is (schemas.parse_time)."""
    try:
        return parse_time(value).timestamp()
    except ValueError as exc:
        raise InvalidInput(f"{field} {exc}", field=field) from None


MAX_DEPTH = 32  # levels of AND / OR / NOT
# Keys and list items in one filter, all levels together: a 1,000-id `in` list fits, and a filter
# can no longer make a search cost seconds of CPU (a 1 MiB body held ~140,000 values).
MAX_TERMS = 2000
EXACT = 2**53  # below it every integer is a float64 of its own


def parse_filters(raw: Any, path: str = "filters", depth: int = 0) -> Condition:
    if depth == 0 and _terms(raw) > MAX_TERMS:
        raise InvalidInput(f"filters hold too many terms ({MAX_TERMS} keys and list items at most, all levels "
                           "together)", field=path)
    if depth > MAX_DEPTH:
        raise InvalidInput(f"filters are nested too deeply ({MAX_DEPTH} levels of AND, OR and NOT at most)", field=path)
    if not isinstance(raw, dict):
        raise InvalidInput(f"{path} must be an object", field=path)
    if not raw:
        raise InvalidInput(f"{path} must not be empty", field=path)
    parts: list[Condition] = []
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key in LOGICAL:
            parts.append(_logical(LOGICAL[key], value, where, depth + 1))
        elif key == "metadata" and isinstance(value, dict):
            if not value:  # it would add no condition: `NOT {"metadata": {}}` matched nothing
                raise InvalidInput(f"{where} must not be empty", field=where)
            parts.extend(_field(f"metadata.{k}", v, f"{where}.{k}") for k, v in value.items())
        else:
            parts.append(_field(key, value, where))
    return parts[0] if len(parts) == 1 else All(tuple(parts))


def _terms(raw: Any) -> int:
    """Keys and list items in a JSON value, all levels together; counting stops past MAX_TERMS."""
    count, pending = 0, [raw]
    while pending and count <= MAX_TERMS:
        node = pending.pop()
        if isinstance(node, dict):
            count += len(node)
            pending.extend(node.values())
        elif isinstance(node, list):
            count += len(node)
            pending.extend(node)
    return count


def _logical(kind: str, value: Any, where: str, depth: int) -> Condition:
    items = [value] if kind == "NOT" and isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise InvalidInput(f"{where} takes a non-empty list of conditions", field=where)
    parsed = tuple(parse_filters(item, f"{where}[{i}]", depth) for i, item in enumerate(items))
    if kind == "AND":
        return All(parsed)
    if kind == "OR":
        return Any_(parsed)
    return Not(parsed[0] if len(parsed) == 1 else Any_(parsed))


def _field(key: str, value: Any, where: str) -> Condition:
    if key in SCOPE_FIELDS or key in TIME_FIELDS:
        payload_key = key
    elif key.startswith("metadata.") and _METADATA_KEY.fullmatch(key[len("metadata."):]):
        payload_key = key
    else:
        raise InvalidInput(
            f"unknown filter field '{key}' (use user_id, agent_id, run_id, created_at, updated_at, expires_at "
            "or metadata.<key>)", field=where)
    if isinstance(value, dict):
        if not value:
            raise InvalidInput(f"{where} needs at least one operator", field=where)
        conditions = []
        for op, operand in value.items():
            if op not in OPERATORS:
                raise InvalidInput(f"unknown filter operator '{op}' (use {', '.join(OPERATORS)})", field=f"{where}.{op}")
            conditions.append(_condition(payload_key, op, operand, f"{where}.{op}"))
        return conditions[0] if len(conditions) == 1 else All(tuple(conditions))
    return _condition(payload_key, "eq", value, where)


def _condition(key: str, op: str, value: Any, where: str) -> Condition:
    if key in SCOPE_FIELDS:
        if op not in ("eq", "ne", "in", "nin"):
            raise InvalidInput(f"{key} supports eq, ne, in, nin", field=where)
        values = _list(value, where) if op in ("in", "nin") else [value]
        for item in values:
            validate_scope_id(item, where)
    elif key in TIME_FIELDS:
        if op in ("in", "nin", "contains"):
            raise InvalidInput(f"{key} supports eq, ne, gt, gte, lt, lte", field=where)
        value = to_epoch(value, where)
    else:
        value = _metadata_operand(op, value, where)
        integers = _integers(value)
        if op in ("eq", "ne", "in", "nin") and integers:
            return _equal_numbers(key, op, integers)

    if op == "eq":
        return Field(key, "eq", value)
    if op == "ne":
        return Not(Field(key, "eq", value))
    if op == "in":
        return Field(key, "in", tuple(value))
    if op == "nin":
        return Not(Field(key, "in", tuple(value)))
    if op == "contains":
        # A list holding the value, or a string containing it.
        return Any_((Field(key, "eq", value), Field(key, "substring", value)))
    return Field(key, op, value)


def _integers(value: Any) -> tuple[int, ...]:
    """The integers of an equality operand, a number or a list of them (booleans are 1 and 0 by now,
    as they are indexed)."""
    items = value if isinstance(value, list) else [value]
    return tuple(items) if items and all(isinstance(v, int) for v in items) else ()


def _equal_numbers(key: str, op: str, integers: tuple[int, ...]) -> Condition:
    """eq / ne / in / nin with integers on metadata: 3 equals a stored 3 and a stored 3.0. The indexes
    match an integer against integers only (exactly), a float operand is a range, which matches both,
    and JSON keeps 3.0 a float. From 2^53 on a float stands for several integers (and an index
    comparing as float64 finds them all in that range): there only the exact integer counts."""
    exact = Field(key, "eq", integers[0]) if op in ("eq", "ne") else Field(key, "in", integers)
    floats = tuple(Field(key, "eq", float(v)) for v in integers if abs(v) < EXACT)
    condition = Any_((exact, *floats)) if floats else exact
    return Not(condition) if op in ("ne", "nin") else condition


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise InvalidInput(f"{where} takes a non-empty list", field=where)
    return value


def _metadata_operand(op: str, value: Any, where: str) -> Any:
    try:
        check_json_values(value)
    except ValueError as exc:
        raise InvalidInput(str(exc).replace("metadata", "filter"), field=where) from None
    if op in RANGE_OPS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{op} on metadata compares numbers", field=where)
        return float(value)  # the indexes compare numbers as float64 (exact below 2^53)
    if op in ("in", "nin"):
        items = _list(value, where)
        if not (all(isinstance(v, str) for v in items)
                or all(isinstance(v, int) and not isinstance(v, bool) for v in items)):
            raise InvalidInput(f"{op} takes a list of strings or a list of integers", field=where)
        return items
    if op == "contains":
        if not isinstance(value, str) or not value:
            raise InvalidInput("contains takes a non-empty string", field=where)
        return value
    if value is None or isinstance(value, (dict, list)):
        raise InvalidInput(f"{op} compares a string, number or boolean", field=where)
    return int(value) if isinstance(value, bool) else value  # see index_sync.payload_metadata


def bounds_scope(node: Condition) -> bool:
    """True when the condition alone confines results to named users/agents/runs."""
    if isinstance(node, Field):
        return node.key in SCOPE_FIELDS and node.op in ("eq", "in")
    if isinstance(node, All):
        return any(bounds_scope(item) for item in node.items)
    if isinstance(node, Any_):
        return all(bounds_scope(item) for item in node.items)
    return False


def restrict(principal: Principal, condition: Condition | None) -> Condition:
    """AND the tenant and the key's own restrictions into a condition; 403 if it names others."""
    parts: list[Condition] = [Field("tenant", "eq", principal.tenant_id)]
    for kind in ("user_id", "agent_id"):
        allowed = principal.allowed(kind)
        if not allowed:
            continue
        if condition is not None:
            for leaf, negated in walk_fields(condition):
                if leaf.key == kind and not negated:
                    values = leaf.value if leaf.op == "in" else (leaf.value,)
                    for value in values:
                        if value not in allowed:
                            raise Forbidden(f"this key may not access {kind} '{value}'", field=f"filters.{kind}")
        parts.append(Field(kind, "in", allowed))
    if condition is not None:
        parts.append(condition)
    return All(tuple(parts))

