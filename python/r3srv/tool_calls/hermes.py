"""Hermes-style JSON calls (`hermes`; Qwen2.5, Qwen3, QwQ and Hermes models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from typing import Any

from r3srv.tool_calls.base import Call, json_object_span, raw_arguments, tagged

START, END = "<tool_call>", "</tool_call>"
# the usual order of the object's keys: the name is known, then the arguments stream as written
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _call(body: str, closed: bool) -> Call | None:
    head = _HEAD.match(body)
    if head is not None:
        name = json.loads(head.group(1))
        rest = body[head.end():]
        span = json_object_span(rest)
        if span is not None:
            arguments = rest[:span]
        else:
            arguments = raw_arguments(rest, False)
        if not closed:
            return Call(name, arguments)
        if span is not None and _parsed(body) is not None:
            return Call(name, arguments, done=True)
    if not closed:
        return Call()  # a call, its name not yet known
    obj = _parsed(body)
    if obj is None:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return Call(obj["name"], text, done=True)


def _parsed(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return obj
    return None


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return tagged(text, final, START, END, _call)
