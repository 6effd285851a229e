"""One chat choice's output read by the server's parsers: reasoning, content and tool calls,
whole (`parse`) or delta by delta (`feed`, then `finish`), the deltas adding up to the whole."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from r3srv.tool_calls import harmony
from r3srv.tool_calls.base import Call, Scan, tool_schemas
from r3srv.tool_calls.reasoning import REASONING_TAGS, split_reasoning


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


@dataclass
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, on a call's first delta
    name: str | None = None


@dataclass
class MessageDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[Call]


class OutputParser:
    """`tool_format`: a module of `FORMATS` when this request's tool calls are parsed (tools
    given, tool_choice "auto"), else None; `reasoning`: a name of `REASONING_PARSERS` or None."""

    def __init__(
        self,
        *,
        tool_format: ModuleType | None,
        reasoning: str | None,
        harmony_format: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
    ) -> None:
        self._format = tool_format
        self._harmony = harmony_format
        tags = REASONING_TAGS.get(reasoning or "")
        self._thinking = tags is not None and tags.thinking(chat_template_kwargs)
        self._schemas = tool_schemas(tools)
        self._include_reasoning = include_reasoning
        self._parallel = parallel_tool_calls
        self._text = ""
        self._sent_reasoning = self._sent_content = 0
        self._sent_calls: list[list[Any]] = []  # [id, characters of arguments sent]

    def _scan(self, text: str, final: bool) -> Scan:
        if self._harmony:
            out = harmony.scan(text, final, self._schemas, calls_wanted=self._format is not None)
        else:
            out = Scan()
            region = text
            if self._thinking:
                start_marker = self._format.START if self._format is not None else None
                out.reasoning, start = split_reasoning(text, final, start_marker)
                if start is None:
                    return out
                region = text[start:]
            if self._format is None:
                out.content = region
            else:
                content, out.calls = self._format.scan(region, final, self._schemas)
                # around calls, whitespace is the template's markup; while streaming, a
                # trailing run waits until it turns out to be inside the content
                out.content = content.strip()
        if not self._parallel:
            out.calls = out.calls[:1]
        if not self._include_reasoning:
            out.reasoning = None
        return out

    def parse(self, text: str) -> ParsedMessage:
        out = self._scan(text, final=True)
        calls = [c for c in out.calls if c.name]
        return ParsedMessage(out.reasoning or None, out.content or None, calls)

    def feed(self, delta: str) -> MessageDelta | None:
        self._text += delta
        return self._diff(self._scan(self._text, final=False))

    def finish(self, delta: str = "") -> MessageDelta | None:
        """The last delta (the output's last text, if any, with whatever waited for the end)."""
        self._text += delta
        return self._diff(self._scan(self._text, final=True))

    @property
    def called_tools(self) -> bool:
        return bool(self._sent_calls)

    def _diff(self, out: Scan) -> MessageDelta | None:
        delta = MessageDelta()
        reasoning = out.reasoning or ""
        if len(reasoning) > self._sent_reasoning:
            delta.reasoning, self._sent_reasoning = reasoning[self._sent_reasoning:], len(reasoning)
        if len(out.content) > self._sent_content:
            delta.content, self._sent_content = out.content[self._sent_content:], len(out.content)
        for index, call in enumerate(out.calls):
            if not call.name:
                break  # its name first; later calls wait for it
            if index == len(self._sent_calls):
                self._sent_calls.append([call.id or make_tool_call_id(), len(call.arguments)])
                delta.tool_calls.append(ToolCallDelta(index, call.arguments, self._sent_calls[index][0], call.name))
                continue
            sent = self._sent_calls[index][1]
            if len(call.arguments) > sent:
                delta.tool_calls.append(ToolCallDelta(index, call.arguments[sent:]))
                self._sent_calls[index][1] = len(call.arguments)
        if delta.reasoning is None and delta.content is None and not delta.tool_calls:
            return None
        return delta
