"""gpt-oss's harmony format against `openai-harmony`, OpenAI's own renderer and parser: messages
it renders (reasoning, a preamble, a function call) read by r3srv's text parser as its token
parser reads them. openai-harmony needs the o200k_base vocabulary file: from
$TIKTOKEN_ENCODINGS_BASE, or the copy the `tiktoken-rs` crate ships (`cargo fetch` puts it in
cargo's registry); without either the test skips, saying so."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from r3srv.tool_calls import output_parser
from tool_call_cases import chunks, generated_calls, streamed


def _vocabulary_dir() -> str | None:
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return os.environ["TIKTOKEN_ENCODINGS_BASE"]
    found = sorted(Path.home().glob(".cargo/registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken"))
    return str(found[-1].parent) if found else None


@pytest.fixture(scope="module")
def encoding():
    harmony = pytest.importorskip("openai_harmony")
    base = _vocabulary_dir()
    if base is None:
        pytest.skip("openai-harmony needs o200k_base.tiktoken: set TIKTOKEN_ENCODINGS_BASE or cargo-fetch tiktoken-rs")
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = base
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if previous is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE")


@pytest.mark.parametrize("seed", range(8))
def test_harmony_messages_read_as_openai_harmony_reads_them(encoding, seed):
    from openai_harmony import Message, Role

    rng = random.Random(seed)
    tools, calls = generated_calls(seed, 1)
    messages = [Message.from_role_and_content(Role.ASSISTANT, rng.choice(["Need a tool.", "Two\nlines."]))
                .with_channel("analysis")]
    if rng.random() < 0.5:
        messages.append(Message.from_role_and_content(Role.ASSISTANT, "Calling it now.").with_channel("commentary"))
    messages.append(Message.from_role_and_content(Role.ASSISTANT, json.dumps(calls[0]["arguments"]))
                    .with_channel("commentary").with_recipient("functions." + calls[0]["name"])
                    .with_content_type("<|constrain|>json"))
    tokens = [t for m in messages for t in encoding.render(m)]
    prompt_end = encoding.encode("<|start|>assistant", allowed_special="all")
    assert tokens[:len(prompt_end)] == prompt_end
    output = tokens[len(prompt_end):]
    if encoding.decode([output[-1]]) == "<|call|>":  # a stop token: the engine leaves its text out
        output = output[:-1]
    oracle = encoding.parse_messages_from_completion_tokens(output, Role.ASSISTANT)
    text = encoding.decode(output)

    def parser():
        return output_parser(tool_parser="openai", reasoning_parser="openai_gptoss", parse_tools=True, tools=tools)

    parsed = parser().parse(text)
    want_reasoning = "".join(m.content[0].text for m in oracle if m.channel == "analysis")
    want_content = "".join(m.content[0].text for m in oracle if m.channel != "analysis" and not m.recipient)
    want_calls = [(m.recipient.removeprefix("functions."), m.content[0].text) for m in oracle if m.recipient]
    assert parsed.reasoning == want_reasoning
    assert (parsed.content or "") == want_content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == want_calls
    parts = streamed(parser(), chunks(text, seed))
    assert [(c["name"], c["arguments"]) for c in parts["calls"]] == want_calls
    assert parts["reasoning"] == want_reasoning
