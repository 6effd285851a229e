"""Values as the peers' request classes take them: pydantic's lax mode, on decoded JSON.

vLLM 0.33 and SGLang 0.5.23 validate their HTTP bodies with pydantic (FastAPI), which converts
`"1234"` into an int, `"true"` or `1` into a bool and `2.0` into an int; being stricter than
the peer breaks real clients (AReaL sends `master_port` as a string). `coerce` applies those
conversions to a body decoded to plain JSON values, field by field along the target Struct's
type, so that msgspec's strict conversion then accepts exactly what pydantic would, with the
same values. A value pydantic refuses is left as it is, for msgspec to name in its 400.

Where a peer is strict (SGLang's `/generate` contract gate types its fields exactly), a
Struct's fields can be left out of the conversion (`strict_fields`); a type annotated with
`Meta(extra={"convert_strings": False})` takes no string (vLLM checks `logprobs` is a number
before pydantic converts it).

The rules, from pydantic's conversion table (JSON input, lax mode), held to pydantic itself
by tests/test_coerce.py on generated values:
- int: a bool; a float with no fractional part (within the 64-bit range); a string of
  decimal digits (surrounding whitespace, `_` between digits and a `.0` tail allowed);
- float: a bool, an int, or a string Python's `float` reads (ASCII only);
- bool: 0 or 1 (also 0.0, 1.0), and the strings `0 1 f t n y no off on yes true false`
  in any case;
- int literals: also a bool or an integral float; str, null: never converted; unions: a member the value already is wins, otherwise the
  first member it converts to, in declaration order (pydantic's "smart" mode).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect as mi

_FAIL = object()  # not convertible: the value stays as sent
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_WHITESPACE = " \t\n\r\x0b\x0c"
_BOOL_TEXT = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
              "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}
_INT64 = 2**63

# Struct -> the fields left exactly as sent (the peer's types them strictly)
StrictFields = Mapping[type, frozenset[str]]


@functools.lru_cache(maxsize=None)
def type_info(target: Any) -> mi.Type:
    return mi.type_info(target)


def coerce(value: Any, target: Any, strict_fields: StrictFields | None = None) -> Any:
    """`value` (decoded JSON) with pydantic's lax conversions towards `target`'s type."""
    out = _coerce(value, type_info(target), strict_fields or {})
    return value if out is _FAIL else out


def _coerce(value: Any, t: mi.Type, strict: StrictFields) -> Any:
    if isinstance(t, mi.StructType):
        return _struct(value, t, strict)
    if isinstance(t, mi.UnionType):
        return _union(value, t, strict)
    if isinstance(t, mi.IntType):
        return _int(value)
    if isinstance(t, mi.FloatType):
        return _float(value)
    if isinstance(t, mi.BoolType):
        return _bool(value)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        if not isinstance(value, list):
            return _FAIL
        return [_keep(item, _coerce(item, t.item_type, strict)) for item in value]
    if isinstance(t, mi.DictType):
        if not isinstance(value, dict):
            return _FAIL
        return {_key(k, t.key_type): _keep(v, _coerce(v, t.value_type, strict)) for k, v in value.items()}
    if isinstance(t, mi.Metadata):
        if isinstance(value, str) and (t.extra or {}).get("convert_strings") is False:
            return _FAIL  # a field the peer checks is a number before converting it
        return _coerce(value, t.type, strict)
    if isinstance(t, mi.LiteralType):
        return _literal(value, t)
    return value if _exact(value, t) else _FAIL


def _key(key: str, t: mi.Type) -> str:
    """An object key (always text in JSON) for a number-keyed dict, in the form msgspec reads."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, (mi.IntType, mi.FloatType)):
        number = _int(key) if isinstance(t, mi.IntType) else _float(key)
        return key if number is _FAIL else str(number)
    return key


def _keep(original: Any, converted: Any) -> Any:
    return original if converted is _FAIL else converted


def _struct(value: Any, t: mi.StructType, strict: StrictFields) -> Any:
    if not isinstance(value, dict):
        return _FAIL
    fields = {f.encode_name: f for f in t.fields}
    exact = strict.get(t.cls, frozenset())
    out = {}
    for name, item in value.items():
        field = fields.get(name)
        out[name] = item if field is None or name in exact else _keep(item, _coerce(item, field.type, strict))
    return out


def _union(value: Any, t: mi.UnionType, strict: StrictFields) -> Any:
    for member in t.types:  # a member the value already is (its items converted)
        if _exact(value, member):
            return _coerce(value, member, strict)
    for member in t.types:
        out = _coerce(value, member, strict)
        if out is not _FAIL:
            return out
    return _FAIL


def _exact(value: Any, t: mi.Type) -> bool:
    """Whether `value` is already of `t`'s JSON type (containers: at the top level)."""
    if isinstance(t, mi.Metadata):
        return _exact(value, t.type)
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.StrType):
        return isinstance(value, str)
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType, mi.TupleType)):
        return isinstance(value, list)
    if isinstance(t, (mi.DictType, mi.StructType, mi.TypedDictType, mi.DataclassType)):
        return isinstance(value, dict)
    if isinstance(t, mi.LiteralType):
        return any(value == v and type(value) is type(v) for v in t.values)
    if isinstance(t, mi.UnionType):
        return any(_exact(value, member) for member in t.types)
    return True  # Any, Raw and the rest: msgspec decides


def _literal(value: Any, t: mi.LiteralType) -> Any:
    """An int literal also takes a bool or an integral float (never a string); others only themselves."""
    if _exact(value, t):
        return value
    if isinstance(value, (bool, float)):
        number = _int(value)
        if any(number == v and type(v) is int for v in t.values):
            return number
    return _FAIL


def _int(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and -_INT64 <= value < _INT64 else _FAIL
    if isinstance(value, str):
        text = value.strip(_WHITESPACE)
        if _INT_TEXT.fullmatch(text):
            return int(text.partition(".")[0])
    return _FAIL


def _float(value: Any) -> Any:
    if isinstance(value, (bool, int)):
        return float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, str) and value.isascii():
        try:
            return float(value)
        except ValueError:
            return _FAIL
    return _FAIL


def _bool(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _BOOL_TEXT.get(value.lower(), _FAIL)
    return _FAIL


def convert(value: Any, target: Any, strict_fields: StrictFields | None = None) -> Any:
    """Decoded JSON -> `target`, converting as pydantic's lax mode does; msgspec.ValidationError
    names what still does not fit."""
    return msgspec.convert(coerce(value, target, strict_fields), target, strict=True, str_keys=True)
