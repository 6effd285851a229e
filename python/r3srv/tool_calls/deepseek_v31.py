"""DeepSeek-V3.1 calls (`deepseek_v31`): the name, then the arguments' JSON::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from typing import Any

from r3srv.tool_calls.base import Call, raw_arguments, sectioned
from r3srv.tool_calls.deepseek_v3 import MARKERS, SEP, START

__all__ = ["START", "scan"]


def _call(body: str, closed: bool) -> Call | None:
    name, sep, arguments = body.partition(SEP)
    if not sep:
        return None if closed else Call()
    return Call(name.strip(), raw_arguments(arguments, closed), done=closed)


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return sectioned(text, final, MARKERS, _call)
