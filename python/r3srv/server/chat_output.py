"""The chat route's reading of outputs: the server's tool-call and reasoning parsers
(`--tool-call-parser`, `--reasoning-parser`, as vLLM's flags) applied to each choice, whole or
streamed, into message / delta fields (r3srv.tool_calls does the reading)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from r3srv.errors import ConfigError
from r3srv.server.protocol import tools as t
from r3srv.tool_calls import REASONING_PARSERS, TOOL_PARSERS, MessageDelta, OutputParser, output_parser

if TYPE_CHECKING:
    from r3srv.server_options import ServerOptions


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers. The tool-call parser reads calls only with auto tool choice on,
    as in vLLM (which ignores --tool-call-parser without --enable-auto-tool-choice)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @classmethod
    def from_options(cls, options: ServerOptions) -> ChatParsers:
        """The parsers the serve flags name (ConfigError for a parser that does not exist)."""
        return cls(options.tool_call_parser, options.reasoning_parser, options.enable_auto_tool_choice)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_parser:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_parser is not None and self.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                              f"{', '.join(REASONING_PARSERS)}")

    @property
    def tools_served(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_parser is not None

    def for_request(self, req: Any, tool_choice: str) -> ChoiceParsing | None:
        """How this request's choices are read, or None: sent as generated."""
        parse_tools = tool_choice == "auto" and self.tools_served
        template_kwargs = req.template_kwargs()
        tools = template_kwargs.get("tools")

        def new() -> OutputParser | None:
            return output_parser(
                tool_parser=self.tool_parser if parse_tools else None, reasoning_parser=self.reasoning_parser,
                parse_tools=parse_tools, tools=tools, chat_template_kwargs=template_kwargs,
                include_reasoning=req.include_reasoning, parallel_tool_calls=req.parallel_tool_calls is not False,
            )

        if new() is None:
            return None
        return ChoiceParsing(new, hide_metadata=not req.include_reasoning)


@dataclass(frozen=True)
class ChoiceParsing:
    new: Any  # () -> OutputParser, one per choice (parsers keep a stream's state)
    # include_reasoning=false: token ids and logprobs would show the reasoning, so they go too (vLLM's rule)
    hide_metadata: bool


def message_fields(parser: OutputParser, text: str, echoed: str) -> dict[str, Any]:
    """ChatMessage fields of a whole choice: content (after echo's text), reasoning, tool calls."""
    parsed = parser.parse(text)
    fields: dict[str, Any] = {"content": (echoed + (parsed.content or "")) or None, "reasoning": parsed.reasoning}
    if parsed.tool_calls:
        fields["tool_calls"] = [
            t.ToolCall(function=t.FunctionCall(name=call.name or "", arguments=call.arguments), **_id(call.id))
            for call in parsed.tool_calls
        ]
    return fields


def _id(model_id: str | None) -> dict[str, str]:
    return {"id": model_id} if model_id else {}


def finish_reason(engine_reason: str | None, called_tools: bool) -> str | None:
    """vLLM's: "tool_calls" when the choice called tools and stopped on its own (a length cut stays visible)."""
    if called_tools and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def delta_fields(delta: MessageDelta | None) -> dict[str, Any]:
    """DeltaMessage fields of one streamed step."""
    if delta is None:
        return {}
    fields: dict[str, Any] = {}
    if delta.content:
        fields["content"] = delta.content
    if delta.reasoning:
        fields["reasoning"] = delta.reasoning
    if delta.tool_calls:
        fields["tool_calls"] = [
            t.DeltaToolCall(
                index=tc.index, id=tc.id, type="function" if tc.id else None,
                function=t.DeltaFunctionCall(name=tc.name, arguments=tc.arguments),
            )
            for tc in delta.tool_calls
        ]
    return fields
