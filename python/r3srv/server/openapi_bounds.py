"""The bounds the server enforces on request bodies, written into the published schema.

Litestar's schema generator keeps a msgspec `Meta` bound on a plain field but drops it where the
annotated type sits in a container or a union (`list[Annotated[int, Meta(ge=0)]]`,
`Annotated[int, Meta(ge=1, le=128)] | None`): the published schema then admitted negative token
ids or `n` of 0, which the server refuses with a 400 naming the field, so clients generated from
the schema and the fuzzers' positive cases sent what is refused. msgspec's own schema of the
same types, the rules the bodies are decoded by, keeps every bound; `restore_bounds` copies each
into the same place of Litestar's component (the matching branch of a union, the items of an
array) where Litestar left it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from litestar.openapi.spec import Reference, Schema

# msgspec's JSON Schema keyword -> litestar.openapi.spec.Schema's attribute
BOUNDS = {"minimum": "minimum", "maximum": "maximum", "exclusiveMinimum": "exclusive_minimum",
          "exclusiveMaximum": "exclusive_maximum", "minLength": "min_length", "maxLength": "max_length",
          "minItems": "min_items", "maxItems": "max_items"}


def body_types(handlers: Iterable[Any]) -> list[Any]:
    """The request body type (`data`) of each route handler that takes one."""
    types = []
    for handler in handlers:
        data = handler.parsed_fn_signature.parameters.get("data")
        if data is not None and data.annotation not in types:
            types.append(data.annotation)
    return types


def restore_bounds(published: dict[str, Schema | Reference], types: Iterable[Any]) -> None:
    """Each bound msgspec enforces on a field of a struct in `types` (and the structs they hold)
    set on that field of the published component of the same name, where it has none."""
    # msgspec's JSON Schema of every struct the bodies decode through, by name
    _, enforced_components = msgspec.json.schema_components(list(types))
    for name, enforced in enforced_components.items():
        component = published.get(name)
        if not isinstance(component, Schema) or not component.properties:
            continue
        for field, rule in enforced.get("properties", {}).items():
            target = component.properties.get(field)
            if isinstance(target, Schema):
                _copy_bounds(rule, target)


def _copy_bounds(rule: dict[str, Any], target: Schema) -> None:
    for branch in _rule_branches(rule):
        for node in _schema_branches(target):
            if not _types(branch) & _types(node):
                continue
            for keyword, attribute in BOUNDS.items():
                if keyword in branch and getattr(node, attribute) is None:
                    setattr(node, attribute, branch[keyword])
            if isinstance(branch.get("items"), dict) and isinstance(node.items, Schema):
                _copy_bounds(branch["items"], node.items)


def _rule_branches(rule: dict[str, Any]) -> list[dict[str, Any]]:
    """A msgspec schema's alternatives (a union's members, nested unions flattened)."""
    for keyword in ("anyOf", "oneOf"):
        if keyword in rule:
            return [b for member in rule[keyword] for b in _rule_branches(member)]
    return [rule]


def _schema_branches(schema: Schema) -> list[Schema]:
    """A published schema's alternatives, as `_rule_branches` (references are other components)."""
    members = [m for group in (schema.one_of, schema.any_of) if group for m in group if isinstance(m, Schema)]
    return [b for m in members for b in _schema_branches(m)] or [schema]


def _types(node: dict[str, Any] | Schema) -> set[str]:
    kind = node.get("type") if isinstance(node, dict) else node.type
    kinds = kind if isinstance(kind, list | tuple) else [kind]
    return {getattr(k, "value", k) for k in kinds if k is not None}
