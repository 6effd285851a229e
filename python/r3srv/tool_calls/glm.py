"""GLM-4.5 / 4.6 (`glm45`) and GLM-4.7 (`glm47`) calls: the name, then key/value tags, with
newlines between them (4.5) or without (4.7)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Strings are written as they are, other values as JSON; the tool's schema types them.
"""

from __future__ import annotations

import re
from typing import Any

from r3srv.tool_calls.base import ArgumentsJson, Call, tagged

START, END = "<tool_call>", "</tool_call>"
KEY = "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _call(body: str, closed: bool, schemas: dict[str, Any]) -> Call | None:
    ends = [i for i in (body.find(KEY), body.find("\n")) if i >= 0]
    if not ends and not closed:
        return Call()  # the name may still grow
    name = body[: min(ends)].strip() if ends else body.strip()
    if not name:
        return None if closed else Call()
    arguments = ArgumentsJson(schemas.get(name))
    for pair in _PAIR.finditer(body):
        arguments.add(pair.group(1).strip(), pair.group(2))
    return Call(name, arguments.text(closed), done=closed)


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return tagged(text, final, START, END, lambda body, closed: _call(body, closed, schemas))
