"""`<think>...</think>` reasoning (`qwen3`, `deepseek_r1`, `deepseek_v3`, `glm45`, `glm47`,
`kimi_k2`): the output starts in reasoning when thinking is on, which ends at `</think>` (or
where tool-call markup starts, as vLLM's parsers for these families end it). The parsers differ
in whether thinking is on, which follows `chat_template_kwargs` as in vLLM 0.33."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from r3srv.tool_calls.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTags:
    default: bool  # thinking without a chat_template_kwargs switch
    keys: tuple[str, ...] = ("thinking", "enable_thinking")  # the switches it reads; () always thinks

    def thinking(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        given = [chat_template_kwargs[k] for k in self.keys if chat_template_kwargs and k in chat_template_kwargs]
        if not given:
            return self.default
        return any(bool(v) for v in given)


REASONING_TAGS = {
    "qwen3": ThinkTags(default=True, keys=("enable_thinking",)),
    "deepseek_r1": ThinkTags(default=True, keys=()),
    "deepseek_v3": ThinkTags(default=False),
    "glm45": ThinkTags(default=True),
    "glm47": ThinkTags(default=True),
    "kimi_k2": ThinkTags(default=True),
}


def split_reasoning(text: str, final: bool, tool_start: str | None) -> tuple[str, int | None]:
    """(reasoning so far, where the content starts or None while reasoning goes on)."""
    ends = [(text.find(THINK_END), len(THINK_END))]
    if tool_start:
        ends.append((text.find(tool_start), 0))
    found = [(i, skip) for i, skip in ends if i >= 0]
    if found:
        i, skip = min(found)
        return text[:i].replace(THINK_START, "", 1), i + skip
    markers = (THINK_START, THINK_END, tool_start) if tool_start else (THINK_START, THINK_END)
    shown = text if final else text[: held_back(text, markers)]
    return shown.replace(THINK_START, "", 1), len(text) if final else None
