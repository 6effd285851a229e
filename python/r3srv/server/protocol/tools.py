"""The chat route's tool-calling and reasoning fields, as vLLM 0.33 spells them: request
`tools` / `tool_choice`, message `tool_calls` / `tool_call_id` / `reasoning`, response
`message.tool_calls` and `delta.tool_calls` (docs/protocol.md, "Tool calling")."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from msgspec import Struct

from r3srv.errors import InvalidRequestError
from r3srv.tool_calls import make_tool_call_id


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # accepted, not enforced: r3srv never constrains sampling (docs/protocol.md)
    strict: bool | None = None


class ChatCompletionToolsParam(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees, as vLLM's model_dump (strict only when set)."""
        function: dict[str, Any] = {"name": self.function.name, "description": self.function.description,
                                    "parameters": self.function.parameters}
        if self.function.strict is not None:
            function["strict"] = self.function.strict
        return {"type": self.type, "function": function}


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(Struct, kw_only=True):
    id: str = msgspec.field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def message_tool_fields(role: str, tool_calls: list[dict[str, Any]] | None, tool_call_id: str | None,
                        reasoning: str | None) -> dict[str, Any]:
    """A message's tool and reasoning fields for the chat template, as vLLM passes them:
    assistant calls' JSON arguments as objects (templates iterate them), the reasoning under
    both names templates read."""
    out: dict[str, Any] = {}
    if role == "assistant":
        if tool_calls:
            out["tool_calls"] = [_template_call(call) for call in tool_calls]
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    if role == "tool" and tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def _template_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(
            call.get("function"), dict):
        raise InvalidRequestError("chat completions only support assistant tool_calls of type 'function'",
                                  param="messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:
            arguments = {}  # as vLLM: a bad history entry must not fail every later turn
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def check_tool_request(tools: list[ChatCompletionToolsParam] | None, tool_choice: ToolChoice | None,
                       tools_served: bool) -> str | None:
    """vLLM's checks of tools and tool_choice, then r3srv's: the effective tool_choice ("none"
    or "auto"), or a 400. `tools_served`: the server reads tool calls (--enable-auto-tool-choice
    with --tool-call-parser)."""
    if tools is not None and not tools:
        raise InvalidRequestError("`tools` must not be an empty array. Either provide at least one tool or "
                                  "omit the field entirely.", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    if not tools:
        raise InvalidRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        if all(t.function.name != tool_choice.function.name for t in tools):
            raise InvalidRequestError("The tool specified in `tool_choice` does not match any of the specified "
                                      "`tools`", param="tool_choice")
    if tool_choice != "auto":
        raise InvalidRequestError(
            param="tool_choice",
            problem=": a named tool or \"required\" forces a call by constrained decoding, which r3srv does not "
            "have (it never changes sampling); send \"auto\" (the model's own calls are parsed) or \"none\"",
        )
    if not tools_served:
        raise InvalidRequestError(
            param="tools",
            problem=": tool calling needs a server started with --enable-auto-tool-choice and "
            "--tool-call-parser NAME (send tool_choice \"none\" to only show the tools to the model)",
        )
    return "auto"
