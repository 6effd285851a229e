"""What every output format shares: the scan result, marker hold-back, blocks between markers.

A format's `scan(text, final)` reads a whole (or partial) output and returns what is safe to
show so far. Scans are prefix-consistent: for a prefix of an output, the content is a prefix
of the whole output's content, the calls a prefix of its calls, each call's arguments a prefix
of that call's arguments, a name once known never changes. Streaming is then one diff per
delta (`output.OutputParser`), and the streamed pieces add up to the non-streamed answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One tool call as far as it is known: `arguments` only grows; `done` once it is closed."""

    name: str | None = None
    arguments: str = ""
    done: bool = False
    id: str | None = None  # the model's own id (Kimi-K2's `functions.name:0`), else one is made


@dataclass
class Scan:
    reasoning: str | None = None  # None: the format has no reasoning (or it is off)
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def held_back(text: str, markers: Sequence[str]) -> int:
    """Where `text` must stop while more may come: before a tail that could still grow into one
    of `markers` (`<tool_ca` may be `<tool_call>`)."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def stable(text: str, final: bool, markers: Sequence[str] = ()) -> str:
    """`text` as far as it can be shown: all of it when final, else without a partial marker."""
    return text if final else text[: held_back(text, markers)]


def raw_arguments(text: str, closed: bool) -> str:
    """A call's arguments as the model wrote them (JSON formats): stripped; while the call is
    open, its trailing whitespace waits (it may be the end of the arguments)."""
    return text.strip() if closed else text.lstrip().rstrip()


@dataclass
class Block:
    text: str
    is_call: bool
    closed: bool = True


def blocks(text: str, start: str, end: str, final: bool) -> Iterator[Block]:
    """Content and `start ... end` blocks in order. While more may come, a partial `start` at
    the end is left out and an open block's text stops before a partial `end`."""
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            yield Block(stable(text[pos:], final, (start,)), False)
            return
        yield Block(text[pos:i], False)
        body_start = i + len(start)
        j = text.find(end, body_start)
        if j < 0:
            yield Block(stable(text[body_start:], final, (end,)), True, closed=False)
            return
        yield Block(text[body_start:j], True)
        pos = j + len(end)


def tagged(text: str, final: bool, start: str, end: str, call: Any) -> tuple[str, list[Call]]:
    """Formats whose calls are `start BODY end` blocks among the content (Hermes, Qwen3-Coder,
    GLM): `call(body, closed)` reads one body (None: not a call, and its text is content)."""
    content: list[str] = []
    calls: list[Call] = []
    for block in blocks(text, start, end, final):
        if not block.is_call:
            content.append(block.text)
            continue
        found = call(block.text, block.closed or final)
        if found is not None:
            calls.append(found)
        elif block.closed:
            content.append(start + block.text + end)
    return "".join(content), calls


def json_object_span(text: str) -> int | None:
    """The length of the JSON value `text` starts with, or None while it is incomplete or invalid."""
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return end


# ---------------------------------------------------------------- arguments written as key/value markup


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    for choice in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(choice) or ():
            types |= _schema_types(option)
    return types or {"string"}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter value written as text (Qwen3-Coder, GLM), typed by the tool's JSON schema as
    vLLM does: the first of null, integer, number, boolean, object, array that reads the text,
    else the text; no schema for the parameter: the text."""
    types = _schema_types(schema)
    if "null" in types and raw.strip().lower() == "null":
        return None
    for kind, read in (("integer", int), ("number", float)):
        if kind in types:
            try:
                return read(raw.strip())
            except ValueError:
                pass
    if "boolean" in types and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    for kind, shape in (("object", dict), ("array", list)):
        if kind in types:
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            if isinstance(value, shape):
                return value
    return raw


class ArgumentsJson:
    """A JSON object built one complete parameter at a time: its text only grows (`{"a": 1`,
    then `{"a": 1, "b": 2`, then `}` when the call closes), so streamed arguments add up to the
    final ones. A repeated key keeps its first value."""

    def __init__(self, schema: Any) -> None:
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        self._properties: Mapping[str, Any] = properties if isinstance(properties, Mapping) else {}
        self._keys: set[str] = set()
        self._parts: list[str] = []

    def add(self, key: str, raw: str) -> None:
        if key in self._keys:
            return
        self._keys.add(key)
        value = typed_value(raw, self._properties.get(key))
        self._parts.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))

    def text(self, closed: bool) -> str:
        body = "{" + ", ".join(self._parts) if self._parts else ""
        if closed:
            return (body or "{") + "}"
        return body


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Function name -> its parameters' JSON schema, from the request's tools."""
    schemas: dict[str, Any] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters")
    return schemas


def sectioned(
    text: str, final: bool, markers: tuple[str, str, str, str], call: Any
) -> tuple[str, list[Call]]:
    """Formats whose calls sit in a section (DeepSeek, Kimi-K2): `markers` are the section's
    start and end and a call's start and end; `call(body, closed)` reads one call's body (None:
    not a call). Text between calls inside a section is markup; text after a section is content."""
    section_start, section_end, call_start, call_end = markers
    content: list[str] = []
    calls: list[Call] = []
    for section in blocks(text, section_start, section_end, final):
        if not section.is_call:
            content.append(section.text)
            continue
        for block in blocks(section.text, call_start, call_end, final or section.closed):
            if block.is_call:
                found = call(block.text, block.closed or final or section.closed)
                if found is not None:
                    calls.append(found)
    return "".join(content), calls
