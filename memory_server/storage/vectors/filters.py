"""A backend-neutral filter tree, validated from the API's filter JSON and translated per backend."""

from dataclasses import dataclass
from typing import Any, Union


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
