"""Kimi-K2 calls (`kimi_k2`); the header is the model's own call id, `functions.NAME:INDEX`,
which becomes the call's id, as in vLLM::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re
from typing import Any

from r3srv.tool_calls.base import Call, raw_arguments, sectioned

START = "<|tool_calls_section_begin|>"
MARKERS = (START, "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>")
ARGUMENTS = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?P<name>[^:]+):\d+")


def _call(body: str, closed: bool) -> Call | None:
    header, sep, arguments = body.partition(ARGUMENTS)
    if not sep:
        return None if closed else Call()
    found = _ID.fullmatch(header.strip())
    if found is None:
        return None if closed else Call()
    name = found.group("name").removeprefix("functions.")
    text = raw_arguments(arguments, closed)
    return Call(name, (text or "{}") if closed else text, done=closed, id=header.strip())


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return sectioned(text, final, MARKERS, _call)
