"""Tool calling end to end: a real server reads a tool call the model is rigged to write
(a tiny Qwen3-MoE checkpoint whose layers add nothing and whose LM head maps each token of a
chain to the next, written by the test; no production switch), streamed and not, parsed by the
`openai` SDK into its typed objects; the prompt rendered with the tools and earlier tool turns
as transformers renders it."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from tokenizers import AddedToken

from r3srv.models.builtin import byte_level_tokenizer, write_byte_level_tokenizer
from r3srv.serial import decode_routed_experts
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, build_hf_model
from tool_call_cases import TEMPLATES

pytestmark = pytest.mark.slow  # a real server, a checkpoint made through transformers
MODEL = "rigged"

REASONING = "\nI need the weather first.\n"
CONTENT = "Let me check."
CALL_ARGS = {"city": "Paris", "days": 3}
CALL_TEXT = "\n" + json.dumps({"name": "get_weather", "arguments": CALL_ARGS}) + "\n"
# the rigged model's output, one added token per piece, then EOS
PIECES = ["<think>", REASONING, "</think>", "\n\n" + CONTENT + "\n", "<tool_call>", CALL_TEXT, "</tool_call>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And in Paris?"},
]


@torch.no_grad()
def _rigged_checkpoint(path):
    """Layers whose outputs are zero (o_proj, down_proj), one-hot embeddings along the chain
    prompt-end -> pieces -> EOS, and an LM head from each to the next: greedy decoding writes
    PIECES whatever the prompt, while the routers still pick experts for every token."""
    tok = byte_level_tokenizer()
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in PIECES])
    vocab = VOCAB_SIZE + len(PIECES)
    model = build_hf_model("qwen3_moe", vocab_size=vocab, hidden_size=32, max_position_embeddings=2048)
    for name, param in model.named_parameters():
        if "o_proj" in name or "down_proj" in name:
            param.zero_()
    model.model.norm.weight.fill_(1.0)
    chain = [tok.token_to_id("Ċ")] + [tok.token_to_id(p) for p in PIECES] + [EOS_TOKEN_ID]
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    head.zero_()
    for i, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[successor, i] = 10.0
    model.save_pretrained(path)
    write_byte_level_tokenizer(path)
    (path / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = _rigged_checkpoint(tmp_path_factory.mktemp("rigged"))
    with RemoteServer(str(path), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--reasoning-parser", "qwen3", "--enable-return-routed-experts", "--served-model-name", MODEL, *TEST_SERVER_ARGS) as srv:
        srv.checkpoint = path
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _request(**extra):
    return dict(model=MODEL, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=32, **extra)


def test_a_tool_call_comes_back_typed(client):
    resp = client.chat.completions.create(**_request(),
                                          extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS
    assert choice.message.content == CONTENT
    assert choice.message.model_extra["reasoning"] == REASONING
    # the rows cover every token but the last, special markup included
    rows = decode_routed_experts(choice.model_extra["routed_experts"])
    assert rows.shape[0] == len(resp.model_extra["prompt_token_ids"]) + len(choice.model_extra["token_ids"]) - 1


def test_the_stream_adds_up_to_the_same_message(client):
    whole = client.chat.completions.create(**_request())
    state = ChatCompletionStreamState()
    reasoning = ""
    for chunk in client.chat.completions.create(**_request(),
                                                stream=True):
        state.handle_chunk(chunk)
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == whole.choices[0].message.content
    [call] = streamed.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        whole.choices[0].message.tool_calls[0].function.name, whole.choices[0].message.tool_calls[0].function.arguments)
    assert reasoning == REASONING


def test_the_prompt_renders_tools_and_tool_turns_as_transformers(client, server):
    from transformers import PreTrainedTokenizerFast

    resp = client.chat.completions.create(**_request(),
                                          extra_body={"return_token_ids": True})
    hf = PreTrainedTokenizerFast(tokenizer_file=str(server.checkpoint / "tokenizer.json"))
    hf.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    history = json.loads(json.dumps(HISTORY))  # arguments as objects, as vLLM hands them to templates
    call = history[1]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    expected = hf.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert hf.decode(resp.model_extra["prompt_token_ids"]) == expected
    assert "get_weather" in expected and "<tool_response>\nsunny\n</tool_response>" in expected


def test_tool_choice_none_sends_the_text(client):
    resp = client.chat.completions.create(**_request(),
                                          tool_choice="none")
    message = resp.choices[0].message
    assert not message.tool_calls and resp.choices[0].finish_reason == "stop"
    assert message.content == "".join(PIECES[3:])  # the reasoning parser still splits the reasoning off
    assert message.model_extra["reasoning"] == REASONING


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": []}, "tools"),
])
def test_tool_requests_refused(client, extra, param):
    body = _request()
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.body["param"] == param


def test_tool_choice_without_tools_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=HISTORY[:1], tool_choice="auto")
    assert err.value.body["param"] == "tool_choice"


def test_rows_of_a_streamed_call(client):
    last = None
    for chunk in client.chat.completions.create(**_request(),
                                                stream=True):
        if chunk.choices and chunk.choices[0].finish_reason:
            last = chunk.choices[0]
    assert last is not None and last.finish_reason == "tool_calls"
    rows = decode_routed_experts(last.model_extra["routed_experts"])
    assert rows.ndim == 3 and np.all(rows >= 0)
