"""vLLM 0.33's own `/v1/completions` tests (its sdist's `tests/entrypoints/openai/completion/` and
the top-level files of `tests/entrypoints/openai/`), restated against `r3srv serve` on its built-in
model: the same requests and the same protocol assertions, with vLLM's model-specific numbers
(prompt lengths of its tokenizer, texts its model writes) taken from r3srv's own /tokenize and
/detokenize instead. Each test names the vLLM test it restates; docs/protocol.md lists the ones left
out and why."""

from __future__ import annotations

import pytest
from openai import BadRequestError

from peer_ports import client, http, model, serve, topology  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.peer]

MAX_LOGPROBS = 20  # vLLM's default max_logprobs, which its tests rely on
CHUNK = 32  # --max-num-batched-tokens: longer prompts prefill in chunks (vLLM's test_chunked_prompt.py)
TOKENS = [1, 2, 3, 4, 5]  # vLLM's tests send [0, 0, 0, 0, 0]; any in-vocabulary ids serve


@pytest.fixture(scope="module")
def server(topology):
    yield from serve(topology, "--enable-prompt-tokens-details", "--max-logprobs", str(MAX_LOGPROBS),
                      "--max-model-len", "128", "--max-num-batched-tokens", str(CHUNK))


def tokenize(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def detokenize(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_single_completion(client, http, model):
    """completion/test_completion.py::test_single_completion"""
    prompt = "Hello, my name is"
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0)
    assert completion.id and len(completion.choices) == 1
    assert completion.choices[0].finish_reason == "length"
    n_prompt = len(tokenize(http, prompt))
    assert completion.usage.completion_tokens == 5 and completion.usage.prompt_tokens == n_prompt
    assert completion.usage.total_tokens == n_prompt + 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0

    completion = client.completions.create(model=model, prompt=TOKENS, max_tokens=5, temperature=0.0)
    assert completion.usage.prompt_tokens == len(TOKENS)
    assert completion.choices[0].prompt_logprobs is None


def test_truncation_side_controls_prompt_truncation(client, model):
    """completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation"""
    ids = list(range(8))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:])):
        completion = client.completions.create(
            model=model, prompt=ids, max_tokens=1, temperature=0.0,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side})
        assert completion.choices[0].prompt_token_ids == kept, side


@pytest.mark.parametrize("logprobs, top", [(None, None), (0, 1), (5, 5)])
def test_completion_logprobs(client, model, logprobs, top):
    """completion/test_completion.py::test_no_logprobs, test_zero_logprobs, test_some_logprobs"""
    completion = client.completions.create(model=model, prompt=TOKENS, max_tokens=5, temperature=0.0,
                                           logprobs=logprobs)
    lp = completion.choices[0].logprobs
    if logprobs is None:
        assert lp is None
        return
    assert len(lp.token_logprobs) == 5 and len(lp.tokens) == 5
    # vLLM: the sampled token joins the top entries when it is not among them
    assert all(top <= len(entry) <= top + 1 for entry in lp.top_logprobs)


def test_too_many_completion_logprobs(client, model):
    """completion/test_completion.py::test_too_many_completion_logprobs"""
    with pytest.raises(BadRequestError):
        client.completions.create(model=model, prompt=TOKENS, max_tokens=5, temperature=0.0,
                                  logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(BadRequestError):
        for _ in client.completions.create(model=model, prompt=TOKENS, max_tokens=5, temperature=0.0,
                                           logprobs=MAX_LOGPROBS + 10, stream=True):
            pass
    # the server still works afterwards
    completion = client.completions.create(model=model, prompt=TOKENS, max_tokens=5, temperature=0.0)
    assert completion.usage.completion_tokens == 5


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, model, prompt_logprobs):
    """completion/test_completion.py::test_prompt_logprobs_completion"""
    params = {"model": model, "prompt": ["A robot may not injure", "My name is"], "max_tokens": 2}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.completions.create(**params)
        return
    completion = client.completions.create(**params)
    for choice in completion.choices:
        if prompt_logprobs is None:
            assert choice.prompt_logprobs is None
        else:
            assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) > 1


def test_completion_streaming(client, model):
    """completion/test_completion.py::test_completion_streaming"""
    prompt = "What is an LLM?"
    single = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0)
    chunks, finishes = [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0,
                                           stream=True):
        chunks.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length"
    assert "".join(chunks) == single.choices[0].text


def test_parallel_no_streaming(client, model):
    """completion/test_completion.py::test_parallel_no_streaming"""
    n = 3
    completion = client.completions.create(model=model, prompt="What is an LLM?", max_tokens=20, n=n,
                                           temperature=1.0, logprobs=0, seed=42)
    assert [c.index for c in completion.choices] == list(range(n))
    assert all(c.finish_reason is not None for c in completion.choices)
    assert len({c.text for c in completion.choices}) == n  # n distinct samples


def test_parallel_streaming(client, model):
    """completion/test_completion.py::test_parallel_streaming"""
    n, max_tokens = 3, 20
    texts: list[list[str]] = [[] for _ in range(n)]
    finishes = 0
    for chunk in client.completions.create(model=model, prompt="What is an LLM?", max_tokens=max_tokens, n=n,
                                           temperature=1.0, stream=True, seed=42):
        texts[chunk.choices[0].index].append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == n
    assert all(len(t) <= max_tokens for t in texts)
    assert len({"".join(t) for t in texts}) == n


def stream_usages(client, model, **options):
    return [(chunk.usage, chunk.choices) for chunk in client.completions.create(
        model=model, prompt="What is the capital of France?", max_tokens=5, temperature=0.0, stream=True,
        **options)]


def test_completion_stream_options(client, model):
    """completion/test_completion.py::test_completion_stream_options"""
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(usage is None for usage, _ in stream_usages(client, model, stream_options=options))

    chunks = stream_usages(client, model, stream_options={"include_usage": True, "continuous_usage_stats": False})
    assert all(usage is None for usage, _ in chunks[:-1])
    usage, choices = chunks[-1]
    assert choices == [] and usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert chunks[-2][1][0].finish_reason is not None  # the usage chunk follows the finishing one

    chunks = stream_usages(client, model, stream_options={"include_usage": True, "continuous_usage_stats": True})
    for usage, _ in chunks:
        assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert chunks[-1][1] == []

    for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(BadRequestError):
            client.completions.create(model=model, prompt="x", max_tokens=5, stream=False, stream_options=options)


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [TOKENS] * 2])
def test_batch_completions(client, model, prompts):
    """completion/test_completion.py::test_batch_completions (its n=2 half uses beam search: out of scope)"""
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0.0)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
    texts = ["", ""]
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0.0, stream=True):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1] == batch.choices[0].text


@pytest.mark.parametrize("logprobs_arg", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", TOKENS])
def test_echo_logprob_completion(client, http, model, logprobs_arg, prompt):
    """completion/test_completion.py::test_echo_logprob_completion"""
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                           logprobs=logprobs_arg)
    prompt_text = detokenize(http, prompt) if isinstance(prompt, list) else prompt
    assert completion.choices[0].text.startswith(prompt_text)
    lp = completion.choices[0].logprobs
    n = len(tokenize(http, prompt_text)) + 5 if isinstance(prompt, str) else len(prompt) + 5
    assert len(lp.text_offset) == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1 for top in lp.top_logprobs[1:])


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_empty_prompt(client, model, prompt):
    """completion/test_prompt_validation.py::test_empty_prompt"""
    with pytest.raises(BadRequestError):
        client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0)


def test_out_of_vocab_token_ids(client, http, model):
    """completion/test_prompt_validation.py::test_out_of_vocab_token_ids"""
    vocab = http.get("/v1/models").json()["data"][0].get("vocab_size") or 259
    with pytest.raises(BadRequestError, match="prompt"):
        client.completions.create(model=model, prompt=[vocab + 1000], max_tokens=5, temperature=0.0)


@pytest.mark.parametrize("prompt", [[-1], [[1, -1]]])
def test_negative_prompt_token_ids(http, prompt):
    """completion/test_completion_error.py::test_negative_prompt_token_ids_flat, _nested"""
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_logprobs_minus_one_allowed(http):
    """completion/test_completion_error.py::test_logprobs_minus_one_allowed: -1 passes validation and
    asks for the whole vocabulary, which (as in vLLM) is then held to max_logprobs: a 400 saying so"""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert f"max allowed: {MAX_LOGPROBS}" in r.json()["error"]["message"]


@pytest.mark.parametrize("logprobs", [-2, "many", 1.5])
def test_bad_logprobs_rejected(http, logprobs):
    """completion/test_completion_error.py::test_logprobs_below_minus_one_rejected,
    test_non_numeric_logprobs_rejected"""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": logprobs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_completion_logprobs_honors_requested_count(client, model):
    """completion/test_completion_error.py::test_completion_logprobs_honors_requested_count"""
    completion = client.completions.create(model=model, prompt="x", max_tokens=3, temperature=0.0, logprobs=3)
    assert all(3 <= len(entry) <= 4 for entry in completion.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("body, param", [
    ({"suffix": "tail"}, "suffix"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs"),
    ({"use_beam_search": True, "echo": True, "logprobs": 1}, "use_beam_search"),
])
def test_unsupported_features_name_their_field(http, body, param):
    """completion/test_completion_error.py::test_completion_suffix_*, test_json_schema_response_format_missing_schema,
    test_structured_outputs_structural_tag_invalid, test_beam_search_echo_logprobs_rejected: vLLM refuses
    these bodies (or serves a feature r3srv does not have); r3srv answers a 400 naming the field"""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stream_text_offset_matches_non_stream_with_stop(client, model):
    """completion/test_completion_text_offset.py::test_stream_text_offset_matches_non_stream_with_stop_holdback"""
    prompt = "Hello, my name is"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text
    stop = full[3:5]  # a stop string the greedy text reaches, so the stream holds text back
    args = dict(model=model, prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0, stop=[stop])
    single = client.completions.create(**args).choices[0]
    offsets, tokens, text = [], [], ""
    for chunk in client.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            offsets += choice.logprobs.text_offset
            tokens += choice.logprobs.tokens
    assert text == single.text and single.finish_reason == "stop"
    assert offsets == single.logprobs.text_offset and tokens == single.logprobs.tokens


def test_token_in_token_out_and_logprobs(client, http, model):
    """completion/test_token_in_token_out.py::test_token_in_token_out_and_logprobs"""
    prompt = tokenize(http, "Hello, my name is")
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0, logprobs=1,
                                           extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = completion.choices[0]
    assert choice.prompt_token_ids == prompt and len(choice.token_ids) == 5
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in choice.token_ids]
    assert choice.text == detokenize(http, choice.token_ids)


def test_completion_return_tokens_as_token_ids(client, model):
    """test_return_tokens_as_ids.py::test_completion_return_tokens_as_token_ids_completion"""
    completion = client.completions.create(model=model, prompt="Say something", max_tokens=5, temperature=0.0,
                                           echo=True, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = completion.choices[0]
    ids = choice.prompt_token_ids + choice.token_ids
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in ids]
    for i, top in zip(ids[1:], choice.logprobs.top_logprobs[1:]):
        assert all(key.startswith("token_id:") for key in top) and f"token_id:{i}" in top


def test_return_token_ids_match_prompt_logprobs(client, model):
    """test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs"""
    completion = client.completions.create(
        model=model, prompt="Hello, world", max_tokens=5, temperature=0.0, logprobs=1,
        extra_body={"return_token_ids": True, "prompt_logprobs": 1, "return_tokens_as_token_ids": True})
    choice = completion.choices[0]
    assert len(choice.prompt_logprobs) == len(choice.prompt_token_ids) and choice.prompt_logprobs[0] is None
    for token_id, entry in zip(choice.prompt_token_ids[1:], choice.prompt_logprobs[1:]):
        assert str(token_id) in entry  # the prompt's own token is always among its prompt logprobs
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in choice.token_ids]


def test_basic_completion_with_emoji(client, http, model):
    """test_return_token_ids.py::test_basic_completion_with_emoji: ids decode to the text, split or not"""
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0.0, logprobs=1,
                                           extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    assert choice.prompt_token_ids == tokenize(http, prompt)
    assert detokenize(http, choice.prompt_token_ids) == prompt
    assert len(choice.token_ids) == 10 and choice.text == detokenize(http, choice.token_ids)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0.0).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None


def test_check_models(client, model):
    """models/test_models.py::test_check_models"""
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].root


def test_completion_stream_options_and_logprobs_with_long_prompts(client, http, model):
    """test_chunked_prompt.py::test_completion_stream_options_and_logprobs_with_long_prompts (a prompt of
    several prefill chunks; the byte-level model can hold a token's text back, so tokens are counted by
    their logprobs, as vLLM's test counts them)"""
    prompt = "What is the capital of France?" * 3
    assert len(tokenize(http, prompt)) > 2 * CHUNK
    received, finished = 0, False
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0, stream=True,
                                           logprobs=5,
                                           stream_options={"include_usage": True, "continuous_usage_stats": True}):
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if not finished:
            assert chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens
            received += len(chunk.choices[0].logprobs.tokens)
            finished = chunk.choices[0].finish_reason is not None
        if finished:
            assert usage.completion_tokens == received == 5
    assert finished
