"""gpt-oss's harmony format (`openai` calls, `openai_gptoss` reasoning), read from the text with
its special tokens kept::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Messages on the `analysis` channel are reasoning, those on `final` (and `commentary` ones
addressed to nobody) content, and those addressed to `functions.NAME` calls. The text form
needs no vocabulary file, unlike `openai-harmony`'s token parser, which the tests use as the
oracle.
"""

from __future__ import annotations

import re
from typing import Any

from r3srv.tool_calls.base import Call, Scan, raw_arguments, stable

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
SPECIALS = ("<|start|>", "<|channel|>", MESSAGE, "<|constrain|>", *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_NEXT_END = re.compile("|".join(re.escape(e) for e in ENDS))


def _messages(text: str, final: bool):
    """(header, body, closed) for each message so far; a header still being written is left out."""
    pos = 0
    while pos < len(text):
        opened = text.find(MESSAGE, pos)
        if opened < 0:
            return
        header = text[pos:opened]
        body_start = opened + len(MESSAGE)
        end = _NEXT_END.search(text, body_start)
        if end is None:
            yield header, stable(text[body_start:], final, SPECIALS), final
            return
        yield header, text[body_start:end.start()], True
        pos = end.end()
        if text.startswith("<|start|>", pos):
            pos += len("<|start|>")


def scan(text: str, final: bool, schemas: dict[str, Any], calls_wanted: bool = True) -> Scan:
    out = Scan(reasoning="")
    for header, body, closed in _messages(text, final):
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if calls_wanted and name.startswith("functions."):
                out.calls.append(Call(name.removeprefix("functions."), raw_arguments(body, closed), done=closed))
        elif channel is not None and channel.group(1) == "analysis":
            out.reasoning += body
        else:  # final, or a commentary preamble
            out.content += body
    return out
