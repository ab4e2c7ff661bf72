"""A backend-neutral filter tree, validated from the API's filter JSON and translated per backend."""

from dataclasses import dataclass
from typing import Any, NamedTuple, Union


@dataclass(frozen=True)
class Field:
    """A leaf: `key` is a payload path (tenant, user_id, created_at, metadata.x, ...)."""

    key: str
    op: str  # eq ne in nin gt gte lt lte substring
    value: Any


@dataclass(frozen=True)
class All:
    items: tuple["Condition", ...]


@dataclass(frozen=True)
class Any_:
    items: tuple["Condition", ...]


@dataclass(frozen=True)
class Not:
    item: "Condition"


Condition = Union[Field, All, Any_, Not]


def all_of(*items: Condition) -> All:
    return All(tuple(items))


def walk_fields(condition: Condition):
    """Yield every Field leaf with whether it sits under an odd number of NOTs."""

    def _walk(node: Condition, negated: bool):
        if isinstance(node, Field):
            yield node, negated
        elif isinstance(node, Not):
            yield from _walk(node.item, not negated)
        else:
            for item in node.items:
                yield from _walk(item, negated)

    yield from _walk(condition, False)


class Flat(NamedTuple):
    """One filter's lists: every `must` holds, at least one `should` (None: no such list), no `must_not`."""

    must: list[Condition]
    should: list[Condition] | None
    must_not: list[Condition]


def flatten(condition: Condition) -> Flat:
    """`condition` as one filter's lists, as flat as the same matches allow: the items of an All
    nested in an All join its `must`, a Not's item its `must_not`, and the items of its first
    non-empty Any_ its `should`. A search's condition is the tenant's and key's restrictions around
    the request's own (filters.restrict), three Alls deep; qdrant-edge-py took ~17 µs to convert
    each filter nested in another on a Zen 1, ~8x a leaf: 59 µs a search, 4 flat (bench/analysis.md,
    round 31)."""
    if isinstance(condition, Any_):
        return Flat([], list(condition.items), [])
    if isinstance(condition, Not):
        return Flat([], None, [condition.item])
    if isinstance(condition, Field):
        return Flat([condition], None, [])
    must: list[Condition] = []
    must_not: list[Condition] = []
    should: list[Condition] | None = None

    def add(node: Condition) -> None:
        nonlocal should
        if isinstance(node, All):
            for item in node.items:
                add(item)
        elif isinstance(node, Not):
            must_not.append(node.item)
        elif isinstance(node, Any_) and node.items and should is None:
            should = list(node.items)
        else:
            must.append(node)

    add(condition)
    return Flat(must, should, must_not)
