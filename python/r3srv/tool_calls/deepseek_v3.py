"""DeepSeek-V3 / R1 calls (`deepseek_v3`)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from typing import Any

from r3srv.tool_calls.base import Call, raw_arguments, sectioned, stable

START = "<｜tool▁calls▁begin｜>"
MARKERS = (START, "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def _call(body: str, closed: bool) -> Call | None:
    _, sep, rest = body.partition(SEP)
    name, newline, fenced = rest.partition("\n")
    if not sep or not (newline or closed):
        return None if closed else Call()
    name = name.strip()
    fenced = fenced.lstrip()
    if not fenced.startswith(FENCE_OPEN):
        return None if closed or not FENCE_OPEN.startswith(fenced) else Call(name)
    inner = fenced[len(FENCE_OPEN):]
    end = inner.find(FENCE_CLOSE)
    if end >= 0:
        return Call(name, raw_arguments(inner[:end], True), done=closed)
    if closed:
        return None
    return Call(name, raw_arguments(stable(inner, False, (FENCE_CLOSE,)), False))


def scan(text: str, final: bool, schemas: dict[str, Any]) -> tuple[str, list[Call]]:
    return sectioned(text, final, MARKERS, _call)
