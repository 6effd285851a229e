"""r3srv.server.coerce converts JSON values exactly as pydantic's lax mode does (the peers validate
their bodies with pydantic), on generated values: the same decision, the same value."""

from __future__ import annotations

import functools
import json
import math
from typing import Annotated, Any, Literal, Optional, Union

import hypothesis.strategies as st
import msgspec
import pydantic
import pytest
from hypothesis import given, settings

from r3srv.server.coerce import convert

pytestmark = pytest.mark.peer  # held to pydantic, the peers' own validator


TYPES: list[Any] = [
    int, float, bool, str, Optional[int], Optional[bool], Optional[float], Union[str, list[str]], list[int],
    dict[str, float], dict[int, float], Union[int, str], Union[str, int], Literal["a", "b"], Literal[1, 2],
    list[Union[int, list[int]]], Optional[list[str]],
]
# What clients put in numeric and boolean fields: numbers as text, bools as text and numbers
_TEXTS = st.sampled_from([
    "1", "+1", "-1", " 1", "1 ", "\t2\n", "1_0", "1__0", "_1", "1.0", "1.00", "1.5", "1e2", "0x1", "01", "\u0661",
    "1.", ".5", "inf", "-inf", "nan", "Infinity", "true", "TRUE", "True", " true", "yes", "Y", "on", "off", "0", "t",
    "f", "n", "no", "", " ", "0.0", "a", "b",
])
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), _TEXTS, st.text(max_size=4),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, 2.0, 1e16, 9.2e18, 9.3e18, -9.3e18, 2.5, 1e20]),
)
VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(_TEXTS, inner, max_size=2)), max_leaves=6)


@functools.lru_cache(maxsize=None)
def _adapter(t: Any) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(t)


@functools.lru_cache(maxsize=None)
def _holder(t: Any) -> type[msgspec.Struct]:
    return msgspec.defstruct("Holder", [("x", t)])


def _pydantic(t: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", _adapter(t).validate_json(json.dumps(value))
    except pydantic.ValidationError:
        return "error", None


def _r3srv(t: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", convert({"x": value}, _holder(t)).x
    except msgspec.ValidationError:
        return "error", None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and (a == b if not isinstance(a, (list, dict)) else repr(a) == repr(b))


@pytest.mark.parametrize("t", TYPES, ids=repr)
@settings(max_examples=100, deadline=None)  # never a timing verdict
@given(value=VALUES)
def test_coerce_agrees_with_pydantic(t, value):
    expected, actual = _pydantic(t, value), _r3srv(t, value)
    assert expected[0] == actual[0], (value, expected, actual)
    assert _same(expected[1], actual[1]), (value, expected, actual)


def test_strict_fields_are_left_as_sent():
    """A field the peer types strictly (SGLang's contract) is not converted; the others are."""
    class Body(msgspec.Struct):
        exact: int = 0
        lax: int = 0

    assert convert({"lax": "3"}, Body, {Body: frozenset({"exact"})}).lax == 3
    with pytest.raises(msgspec.ValidationError, match="exact"):
        convert({"exact": "3"}, Body, {Body: frozenset({"exact"})})


def test_numbers_only_fields_take_no_strings():
    """vLLM checks `logprobs` is a number before pydantic converts it: 2.0 passes, "2" does not."""
    count = Annotated[int, msgspec.Meta(extra={"convert_strings": False})]
    holder = msgspec.defstruct("Holder", [("x", Optional[count])])
    assert convert({"x": 2.0}, holder).x == 2
    with pytest.raises(msgspec.ValidationError):
        convert({"x": "2"}, holder)


def test_routes_without_a_field_table_convert_too():
    """Control routes (no field table) take pydantic's conversions, as SGLang's FastAPI handlers:
    AReaL sends /init_weights_update_group's master_port as a string."""
    from r3srv.server.body import decode_body
    from r3srv.server.protocol.weight_sync import InitWeightsUpdateGroupRequest

    body = b'{"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": "1", "world_size": 2}'
    request = decode_body(body, InitWeightsUpdateGroupRequest, None)
    assert (request.master_port, request.rank_offset) == (29500, 1)
