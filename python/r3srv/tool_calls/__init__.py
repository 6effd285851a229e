"""Tool calls and reasoning in chat outputs, by vLLM 0.33's parser names.

`--tool-call-parser NAME` (with `--enable-auto-tool-choice`) reads the model's own tool-call
format into `message.tool_calls`; `--reasoning-parser NAME` its reasoning into
`message.reasoning`. One module per format; `output.OutputParser` composes them for a choice,
whole or streamed.
"""

from __future__ import annotations

from types import ModuleType

from r3srv.tool_calls import deepseek_v3, deepseek_v31, glm, harmony, hermes, kimi_k2, qwen3_xml
from r3srv.tool_calls.output import MessageDelta, OutputParser, ParsedMessage, ToolCallDelta, make_tool_call_id
from r3srv.tool_calls.reasoning import REASONING_TAGS

# vLLM's names -> the format's module (None: gpt-oss's harmony, read with its channels)
TOOL_PARSERS: dict[str, ModuleType | None] = {
    "hermes": hermes,
    "qwen3_json": hermes,  # vLLM's alias
    "qwen3_coder": qwen3_xml,
    "qwen3_xml": qwen3_xml,
    "deepseek_v3": deepseek_v3,
    "deepseek_v31": deepseek_v31,
    "glm45": glm,
    "glm47": glm,
    "kimi_k2": kimi_k2,
    "openai": None,
}
HARMONY_REASONING = "openai_gptoss"
REASONING_PARSERS = (*REASONING_TAGS, HARMONY_REASONING)


def output_parser(
    *,
    tool_parser: str | None,
    reasoning_parser: str | None,
    parse_tools: bool,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    include_reasoning: bool = True,
    parallel_tool_calls: bool = True,
) -> OutputParser | None:
    """The parser of one choice, or None when the server's parsers have nothing to do for this
    request (no reasoning parser, and no tool calls to read)."""
    harmony_format = tool_parser == "openai" or reasoning_parser == HARMONY_REASONING
    tool_format = None
    if parse_tools and tool_parser is not None:
        tool_format = harmony if harmony_format else TOOL_PARSERS[tool_parser]
    if tool_format is None and reasoning_parser is None:
        return None
    return OutputParser(
        tool_format=tool_format, reasoning=reasoning_parser, harmony_format=harmony_format, tools=tools,
        chat_template_kwargs=chat_template_kwargs, include_reasoning=include_reasoning,
        parallel_tool_calls=parallel_tool_calls,
    )

__all__ = [
    "HARMONY_REASONING", "REASONING_PARSERS", "TOOL_PARSERS", "MessageDelta", "OutputParser", "ParsedMessage",
    "ToolCallDelta", "make_tool_call_id", "output_parser",
]
