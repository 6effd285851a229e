"""Qwen3-Coder's XML calls (`qwen3_coder`, `qwen3_xml`)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are text; the tool's JSON schema types them (`base.typed_value`), as vLLM does.
"""

from __future__ import annotations

import re
from typing import Any

from r3srv.tool_calls.base import ArgumentsJson, Call, tagged

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_OPEN_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)


def _value(raw: str) -> str:
    """One newline on each side is the template's markup."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _call(body: str, closed: bool, schemas: dict[str, Any]) -> Call | None:
    head = _NAME.match(body)
    if head is None:
        return None if closed else Call()
    name = head.group(1).strip()
    arguments = ArgumentsJson(schemas.get(name))
    pos = head.end()
    for param in _PARAM.finditer(body, pos):
        arguments.add(param.group(1).strip(), _value(param.group(2)))
        pos = param.end()
    if closed:  # a last parameter the model did not close
        tail = _OPEN_PARAM.search(body, pos)
        if tail is not None:
            arguments.add(tail.group(1).strip(), _value(tail.group(2)))
    return Call(name, arguments.text(closed), done=closed)


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return tagged(text, final, START, END, lambda body, closed: _call(body, closed, schemas))
