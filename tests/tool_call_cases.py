"""Generated tool calls rendered by the families' own chat templates (tests/data/chat_templates),
and a streaming reader that adds an OutputParser's deltas up, for tests/test_tool_calls*.py."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3srv.models.builtin import byte_level_tokenizer
from r3srv.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# what the engine leaves out of a choice's text: the turn's end (a stop token)
TURN_ENDS = ("<|im_end|>\n", "<|im_end|>", "<｜end▁of▁sentence｜>", "<|call|>", "<|return|>", "<|end|>", "\n")


@dataclass(frozen=True)
class Case:
    template: str
    tool_parser: str
    reasoning_parser: str | None = None
    reasoning: bool = False  # the assistant message carries reasoning the template renders
    content: bool = True  # ... and content before its calls
    max_calls: int = 3
    header: str = ""  # where the output starts, when the prompt is not a prefix of the conversation


CASES = {
    "hermes": Case("Qwen-Qwen3-0.6B.jinja", "hermes", "qwen3", reasoning=True),
    "qwen3_coder": Case("Qwen3-Coder.jinja", "qwen3_coder"),
    "deepseek_v3": Case("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", content=False,
                        header="<｜Assistant｜>"),
    "deepseek_v31": Case("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v31"),
    "glm45": Case("GLM-4.6.jinja", "glm45", "glm45", reasoning=True),
    "glm47": Case("GLM-4.7-Flash.jinja", "glm47", "glm47", reasoning=True),
    "kimi_k2": Case("moonshotai-Kimi-K2.jinja", "kimi_k2"),
    "openai": Case("openai-gpt-oss-120b.jinja", "openai", "openai_gptoss", reasoning=True, content=False, max_calls=1),
}


def template_tokenizer(template: str) -> Tokenizer:
    """r3srv's own renderer with the family's template (the vocabulary does not matter here)."""
    return Tokenizer(byte_level_tokenizer(), bos_token="<｜begin▁of▁sentence｜>",
                     chat_template=(TEMPLATES / template).read_text(encoding="utf-8"))


_WORDS = ["Paris", "weather", "it's", "naïve", "東京", "a \"quote\"", "50%", "x{y}", "tab\there", "two words"]


def _value(rng: random.Random, depth: int = 0) -> tuple[Any, dict[str, Any]]:
    kind = rng.choice(["string", "integer", "number", "boolean", "array", "object"] if depth == 0
                      else ["string", "integer", "boolean"])
    if kind == "string":
        return " ".join(rng.sample(_WORDS, rng.randint(1, 3))), {"type": "string"}
    if kind == "integer":
        return rng.randint(-1000, 100000), {"type": "integer"}
    if kind == "number":
        return round(rng.uniform(-50, 50), 3), {"type": "number"}
    if kind == "boolean":
        return rng.random() < 0.5, {"type": "boolean"}
    if kind == "array":
        return [rng.randint(0, 9) for _ in range(rng.randint(0, 4))], {"type": "array", "items": {"type": "integer"}}
    inner, schema = _value(rng, depth + 1)
    return {"k": inner, "n": rng.randint(0, 5)}, {"type": "object", "properties": {"k": schema}}


def generated_calls(seed: int, max_calls: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(tools, calls): 1..max_calls calls of generated functions, arguments with every JSON type."""
    rng = random.Random(seed)
    tools, calls = [], []
    for i in range(rng.randint(1, max_calls)):
        name = f"{rng.choice(['get', 'set', 'find'])}_{rng.choice(['weather', 'file', 'user'])}_{i}"
        args, props = {}, {}
        for j in range(rng.randint(0, 4)):
            args[f"p{j}"], props[f"p{j}"] = _value(rng)
        tools.append({"type": "function", "function": {"name": name, "description": f"tool {i}",
                                                        "parameters": {"type": "object", "properties": props}}})
        calls.append({"name": name, "arguments": args})
    return tools, calls


def rendered_output(case: Case, seed: int) -> tuple[str, dict[str, Any]]:
    """A model's output as the family's template writes it (a past assistant turn: reasoning,
    content, tool calls), and what a parser must read from it."""
    rng = random.Random(seed)
    tools, calls = generated_calls(seed, case.max_calls)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What should I do?"}]
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": rng.choice(["Let me check.", "I will call a tool: {\"not\": \"a call\"}"]) if case.content else None,
        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(calls)],
    }
    reasoning = rng.choice(["The user wants a tool.", "Two steps:\nfirst, then second."]) if case.reasoning else None
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
        assistant["thinking"] = reasoning  # gpt-oss's field
    if case.template.startswith("openai"):
        assistant.pop("content")
    tok = template_tokenizer(case.template)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    full = tok.apply_chat_template(messages + [assistant], add_generation_prompt=False, tools=tools)
    if case.header:
        output = full[full.rindex(case.header) + len(case.header):]
    else:
        assert full.startswith(prompt), (prompt, full)
        output = full[len(prompt):]
    for end in TURN_ENDS:
        output = output.removesuffix(end)
    expected = {"calls": calls, "content": assistant.get("content"), "reasoning": reasoning, "tools": tools}
    return output, expected


def chunks(text: str, seed: int) -> list[str]:
    """`text` cut at random places (pieces of 1 to 7 characters): markers arrive in pieces."""
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        out.append(text[pos:pos + step])
        pos += step
    return out


def streamed(parser: Any, pieces: list[str]) -> dict[str, Any]:
    """Every delta of `parser` over `pieces`, added up the way a client does."""
    reasoning, content, calls = "", "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls:
            if tc.index == len(calls):
                assert tc.name and tc.id, "a call's first delta names it"
                calls.append({"id": tc.id, "name": tc.name, "arguments": ""})
            assert tc.index < len(calls)
            calls[tc.index]["arguments"] += tc.arguments
    return {"reasoning": reasoning or None, "content": content or None, "calls": calls}


def arguments_of(text: str) -> Any:
    return json.loads(text)
