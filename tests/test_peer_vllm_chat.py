"""vLLM 0.33's own `/v1/chat/completions` tests (its sdist's `tests/entrypoints/openai/chat_completion/`
and `test_return_tokens_as_ids.py`), restated against `r3srv serve` on its built-in model. vLLM's
model-specific numbers (a prompt of 37 tokens, a vocabulary size, "2" as the answer to 1+1) become
r3srv's own (/tokenize, the model card); each test names the vLLM test it restates, and
docs/protocol.md lists the ones left out and why."""

from __future__ import annotations

import json
from collections import defaultdict

import openai
import pytest
from openai import BadRequestError

from peer_ports import client, http, model, serve, topology  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.peer]

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
VOCAB = 259  # the built-in model's vocabulary (asserted by test_vocab_is_the_models)
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


@pytest.fixture(scope="module")
def server(topology):
    # prompts past 32 tokens prefill in chunks (vLLM's test_chunked_prompt.py runs chunked prefill)
    yield from serve(topology, "--max-logprobs", str(MAX_LOGPROBS), "--max-model-len", "256", "--max-num-batched-tokens", "32")


def test_vocab_is_the_models(http):
    r = http.post("/detokenize", json={"tokens": [VOCAB - 1]})
    assert r.status_code == 200 and http.post("/detokenize", json={"tokens": [VOCAB]}).status_code == 400


def prompt_tokens(http, messages) -> int:
    return len(http.post("/tokenize", json={"messages": messages}).json()["tokens"])


def test_single_chat_session(client, http, model):
    """chat_completion/test_chat.py::test_single_chat_session (its LoRA case: out of scope)"""
    messages = list(MESSAGES)
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, logprobs=True,
                                          top_logprobs=5)
    assert chat.id and len(chat.choices) == 1 and chat.choices[0].finish_reason == "length"
    n = prompt_tokens(http, messages)
    assert chat.usage == openai.types.CompletionUsage(completion_tokens=5, prompt_tokens=n, total_tokens=n + 5)
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content is not None
    assert len(chat.choices[0].logprobs.content) == 5
    messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "in json"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5)
    assert chat.choices[0].message.content is not None


@pytest.mark.parametrize("logprobs, top", [(False, None), (True, 0), (True, 5)])
def test_chat_logprobs(client, model, logprobs, top):
    """chat_completion/test_chat.py::test_no_logprobs_chat, test_zero_logprobs_chat, test_some_logprobs_chat"""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
                                          logprobs=logprobs, top_logprobs=top)
    lp = chat.choices[0].logprobs
    if not logprobs:
        assert lp is None
        return
    assert len(lp.content) == 5
    assert all(len(entry.top_logprobs) == top for entry in lp.content)


def test_too_many_chat_logprobs(client, model):
    """chat_completion/test_chat.py::test_too_many_chat_logprobs"""
    with pytest.raises(BadRequestError):
        for _ in client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=MAX_LOGPROBS + 1, stream=True):
            pass
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10, logprobs=True,
                                       top_logprobs=MAX_LOGPROBS + 10)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10)
    assert chat.choices[0].message.content is not None  # the server still works


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, http, model, prompt_logprobs):
    """chat_completion/test_chat.py::test_prompt_logprobs_chat. vLLM refuses -1 here (the whole
    vocabulary, above its max_logprobs of 20), as r3srv does"""
    params = {"model": model, "messages": CONVERSATION, "max_completion_tokens": 2}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.chat.completions.create(**params)
        return
    chat = client.chat.completions.create(**params)
    if prompt_logprobs is None:
        assert chat.prompt_logprobs is None
    else:
        assert len(chat.prompt_logprobs) == prompt_tokens(http, CONVERSATION) and chat.prompt_logprobs[0] is None


def test_more_than_one_prompt_logprobs_chat(client, model):
    """chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat: the prompt's own token
    joins the top-k when it is not among them, so an entry holds k or k + 1"""
    for k in (1, 2):
        chat = client.chat.completions.create(model=model, messages=CONVERSATION, max_completion_tokens=2,
                                              extra_body={"prompt_logprobs": k})
        assert all(k <= len(entry) <= k + 1 for entry in chat.prompt_logprobs[1:])


def test_chat_streaming(client, model):
    """chat_completion/test_chat.py::test_chat_streaming"""
    single = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10,
                                            temperature=0.0).choices[0]
    chunks, finishes = [], 0
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10,
                                                temperature=0.0, stream=True):
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == single.finish_reason
    assert "".join(chunks) == single.message.content


def test_chat_completion_stream_options(client, model):
    """chat_completion/test_chat.py::test_chat_completion_stream_options"""
    args = dict(model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0.0)
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": False}, **args):
        assert chunk.usage is None
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}, **args))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 10
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(BadRequestError):
            client.chat.completions.create(stream=False, stream_options=options, **args)
    last = 0
    for chunk in client.chat.completions.create(stream=True, extra_body={"min_tokens": 10},
                                                stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True}, **args):
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert last == 0 or usage.completion_tokens > last or (not chunk.choices and usage.completion_tokens == last)
        last = usage.completion_tokens
    assert last == 10


def test_extra_fields_allowed(client, model):
    """chat_completion/test_chat.py::test_extra_fields_allowed"""
    messages = [{"role": "user", "content": "what is 1+1?", "extra_field": "0"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0,
                                          seed=0)
    assert chat.choices[0].message.content is not None


def test_complex_message_content(client, model):
    """chat_completion/test_chat.py::test_complex_message_content: text parts read as the string
    (vLLM's answer "2" is its model's; here the same text as a string content gives the same reply)"""
    text = "what is 1+1? please provide the result without any other text."
    replies = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                              max_completion_tokens=5, temperature=0, seed=0).choices[0].message.content
               for content in ([{"type": "text", "text": text}], text)]
    assert replies[0] == replies[1]


def test_custom_role(client, model):
    """chat_completion/test_chat.py::test_custom_role"""
    replies = [client.chat.completions.create(model=model, messages=[{"role": "my-custom-role", "content": content}],
                                              max_completion_tokens=5, temperature=0, seed=0).choices[0].message.content
               for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert replies[0] == replies[1]


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_long_seed(http, seed):
    """chat_completion/test_chat.py::test_long_seed"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES[:1], "temperature": 0, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert ">=" in r.json()["error"]["message"] or "<=" in r.json()["error"]["message"]


def test_chat_completion_n_parameter_non_streaming(client, model):
    """chat_completion/test_chat.py::test_chat_completion_n_parameter_non_streaming, test_chat_completion_n_with_seed,
    test_chat_completion_n_equals_1"""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=20, temperature=1.0,
                                          n=3, seed=42)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in chat.choices)
    assert len({c.message.content for c in chat.choices}) > 1
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, n=1)
    assert [c.index for c in chat.choices] == [0]


def test_chat_completion_n_parameter_streaming(client, model):
    """chat_completion/test_chat.py::test_chat_completion_n_parameter_streaming"""
    by_index = defaultdict(list)
    roles = defaultdict(int)
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=15,
                                                temperature=0.7, n=2, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.delta.content:
                by_index[choice.index].append(choice.delta.content)
    assert sorted(by_index) == [0, 1] and all(by_index.values())
    assert roles == {0: 1, 1: 1}  # each choice opens with its role once


@pytest.mark.parametrize("n", [100_000_000, 129])
def test_n_parameter_exceeds_limit(http, n):
    """chat_completion/test_chat.py::test_chat_completion_request_n_parameter_exceeds_default_limit,
    test_chat_completion_request_n_parameter_massive_value"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "n": n, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_null_top_logprobs_is_same_as_omitted(http):
    """chat_completion/test_chat.py::test_null_top_logprobs_is_same_as_omitted"""
    bodies = [{"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "logprobs": True, **extra}
              for extra in ({"top_logprobs": None}, {})]
    a, b = (http.post("/v1/chat/completions", json=body).json() for body in bodies)
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"] is not None


@pytest.mark.parametrize("effort, status", [("low", 200), ("none", 200), ("extreme", 400)])
def test_reasoning_effort(http, effort, status):
    """chat_completion/test_chat.py::test_chat_completion_request_accepts_model_specific_reasoning_effort,
    test_chat_completion_request_rejects_unknown_reasoning_effort"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "reasoning_effort": effort})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(client, model, echo):
    """chat_completion/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message
    (vLLM's model stops by itself; the built-in one runs to max_tokens)"""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    chat = client.chat.completions.create(
        model=model, max_completion_tokens=5,
        messages=[{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False})
    message = chat.choices[0].message
    assert message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    assert (saying in message.content) == echo
    if echo:
        assert message.content.startswith(saying)


def test_echo_prompt_logprobs(client, http, model):
    """chat_completion/test_chat_echo.py::test_prompt_logprobs: vLLM's fixture raises max_logprobs to
    the vocabulary, so -1 (all of it) is served; here the request asks for the top 20"""
    messages = [{"role": "user", "content": "Beijing is the capital of which country?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=1,
                                          extra_body={"prompt_logprobs": MAX_LOGPROBS})
    assert len(chat.prompt_logprobs) == prompt_tokens(http, messages)


def test_echo_top_logprobs(http):
    """chat_completion/test_chat_echo.py::test_top_logprobs: -1 is the whole vocabulary; r3srv holds it
    to --max-logprobs as vLLM does (vLLM's fixture raises max_logprobs; at 20 vLLM refuses too)"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True,
                                                "top_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_chat_logit_bias_valid(client, http, model):
    """chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_valid (and the bias acts:
    +100 on one token makes greedy decoding write only it)"""
    token = http.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"][0]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                          temperature=0.0, logit_bias={str(token): 100},
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == [token] * 5


@pytest.mark.parametrize("bias, words", [
    ({str(VOCAB + 1): 1.0}, [str(VOCAB + 1), "logit_bias"]),
    ({"not_a_token_id": 50}, ["not_a_token_id", "logit_bias"]),
    ({"1": "not_a_number"}, ["logit_bias"]),
    ({"bad_a": 1, "bad_b": 2}, ["logit_bias"]),
])
def test_chat_logit_bias_invalid(http, bias, words):
    """chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_invalid,
    test_chat_logit_bias_non_integer_key, test_chat_logit_bias_non_numeric_value,
    test_chat_logit_bias_multiple_non_integer_keys"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert all(word in r.json()["error"]["message"] for word in words), r.text


@pytest.mark.parametrize("payload", ["this is not valid json{{{", ["not", "an", "object"], 42, None])
def test_chat_completion_request_rejects_non_object_body(http, payload):
    """chat_completion/test_non_object_body_validation.py::test_chat_completion_request_rejects_non_object_body"""
    content = payload if isinstance(payload, str) else json.dumps(payload)
    r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_cache_salt_still_validated(http):
    """chat_completion/test_non_object_body_validation.py::
    test_chat_completion_request_cache_salt_still_validated_on_dict"""
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_chat_return_tokens_as_token_ids(client, model):
    """test_return_tokens_as_ids.py::test_chat_return_tokens_as_token_ids_completion"""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = chat.choices[0]
    assert [entry.token for entry in choice.logprobs.content] == [f"token_id:{i}" for i in choice.token_ids]
    assert all(top.token.startswith("token_id:") for entry in choice.logprobs.content for top in entry.top_logprobs)


def test_chat_completion_stream_options_and_logprobs_with_long_prompts(client, http, model):
    """test_chunked_prompt.py::test_chat_completion_stream_options_and_logprobs_with_long_prompts"""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?" * 3}]
    assert prompt_tokens(http, messages) > 64
    received, empty, finished = 0, 0, False
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0.0,
                                                stream=True, logprobs=True, top_logprobs=5,
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}):
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if not finished:
            choice = chunk.choices[0]
            if choice.delta.role == "assistant":  # the role-only opening chunk: no token yet
                assert usage.completion_tokens == 0 and choice.logprobs is None
                empty += 1
            else:
                assert choice.logprobs and choice.logprobs.content
                received += len(choice.logprobs.content)
            finished = choice.finish_reason is not None
        if finished:
            assert usage.completion_tokens == received == 5
    assert finished and empty <= 1
