"""The sampling fields through a real server, as clients send them (the openai SDK, httpx for
the token-in/token-out and SGLang routes), each shown by its effect and held against the
offline LLM (whose own results tests/test_sampling_fields.py holds against transformers):
logit_bias, penalties, prompt logprobs (vLLM's and SGLang's), echo, continuous usage, cache
salts, truncate_prompt_tokens, top_logprobs -1, include_stop_str_in_output."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from step_gate import one_step_per_item

from r3srv import LLM, SamplingParams
from r3srv.serial import decode_routed_experts

pytestmark = pytest.mark.slow  # real servers

PROMPT = "Rollouts for RL"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(gate):
    # prompt_tokens_details (cached tokens) only with the flag, as vLLM
    with RemoteServer("--enable-return-routed-experts", "--enable-prompt-tokens-details", *TEST_SERVER_ARGS,
                      step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline():
    return LLM(max_model_len=256, num_kv_blocks=64)


def post(server, route: str, body: dict) -> dict:
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_steers_every_route(server, client, model):
    bias = {"65": 100}  # "A"
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logit_bias=bias, **{"temperature": 0})
    assert done.choices[0].text == "AAAA"
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias=bias)
    assert chat.choices[0].message.content == "AAAA"
    tito = post(server, "/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {
        "max_tokens": 4, "logit_bias": {"66": 100}, **GREEDY}})
    assert tito["choices"][0]["token_ids"] == [66] * 4
    sglang = post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "logit_bias": {"67": 100}, **GREEDY}})
    assert sglang["output_ids"] == [67] * 4


def test_penalties_and_min_p_sample_as_the_offline_engine(server, client, model, offline):
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05)
    seeded = dict(temperature=1.0, seed=11, max_tokens=16)
    got = client.completions.create(model=model, prompt=PROMPT, **seeded, presence_penalty=1.5, frequency_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "return_token_ids": True})
    want = offline.generate([PROMPT], SamplingParams(**seeded, **fields))[0].outputs[0].token_ids
    plain = offline.generate([PROMPT], SamplingParams(**seeded))[0].outputs[0].token_ids
    assert got.choices[0].token_ids == want and want != plain
    # SGLang's names; its repetition penalty leaves the prompt out
    out = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 11, "repetition_penalty": 1.3, "min_p": 0.05,
        "presence_penalty": 1.5}})
    sglang = SamplingParams(**seeded, repetition_penalty=1.3, repetition_penalty_prompt=False, min_p=0.05,
                            presence_penalty=1.5)
    assert out["output_ids"] == offline.generate([PROMPT], sglang)[0].outputs[0].token_ids


def _assert_same_prompt_logprobs(wire: list, engine: list, k: int, tokenizer) -> None:
    assert len(wire) == len(engine) and wire[0] is None and engine[0] is None
    for got, want in zip(wire[1:], engine[1:]):
        assert [int(t) for t in got] == list(want)
        for t, lp in want.items():
            entry = got[str(t)]
            assert math.isclose(entry["logprob"], lp.logprob, abs_tol=1e-5) and entry["rank"] == lp.rank
            assert entry["decoded_token"] == tokenizer.decode([t], skip_special_tokens=False)
        assert sum(1 for lp in want.values() if lp.rank <= k) == k


def test_prompt_logprobs_on_every_route(server, client, model, offline):
    ids = list(PROMPT.encode())
    engine = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))[0].prompt_logprobs
    done = client.completions.create(model=model, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    _assert_same_prompt_logprobs(done.choices[0].prompt_logprobs, engine, 2, offline.tokenizer)
    tito = post(server, "/inference/v1/generate", {"token_ids": ids, "sampling_params": {
        "max_tokens": 1, "prompt_logprobs": 2}})
    _assert_same_prompt_logprobs(tito["prompt_logprobs"], engine, 2, offline.tokenizer)
    # repeated: its blocks are cached, still every prompt logprob is there
    again = client.completions.create(model=model, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    _assert_same_prompt_logprobs(again.choices[0].prompt_logprobs, engine, 2, offline.tokenizer)
    # SGLang's: [logprob, id, None] from logprob_start_len on, the first without a logprob
    start = 4
    meta = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1},
                                      "return_logprob": True, "logprob_start_len": start,
                                      "top_logprobs_num": 2})["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[start:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for (lp, t, _), tops, want in zip(meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:],
                                      engine[start + 1:]):
        assert math.isclose(lp, want[t].logprob, abs_tol=1e-5)
        assert [tt for _, tt, _ in tops] == [tt for tt, e in sorted(want.items(), key=lambda kv: kv[1].rank)][:2]
    assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] == 1


def test_chat_prompt_logprobs_and_echo(client, model):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False})
    echoed = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"add_generation_prompt": False, "echo": True})
    assert echoed.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    assert echoed.choices[0].message.role == "assistant"
    # vLLM's chat echo also asks for the prompt's logprobs (top_logprobs of them)
    assert echoed.prompt_logprobs[0] is None and len(echoed.prompt_logprobs) == echoed.usage.prompt_tokens
    assert plain.prompt_logprobs is None
    user_last = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=4, temperature=0,
                                               extra_body={"echo": True})
    reference = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=4, temperature=0)
    assert user_last.choices[0].message.content == reference.choices[0].message.content  # roles differ: no echo
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"add_generation_prompt": False, "echo": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content


def test_completion_echo_with_and_without_logprobs(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 4 and "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(PROMPT) and "".join(chunks) == echoed.choices[0].text


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_on_every_chunk(client, model, route, gate):
    options = {"include_usage": True, "continuous_usage_stats": True}
    with gate.allowing(1):  # then a step per chunk read: a chunk per step or so, however fast the engine
        if route == "completions":
            stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                               stream_options=options, extra_body={"ignore_eos": True})
        else:
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, temperature=0, stream=True, stream_options=options,
                                                    extra_body={"ignore_eos": True})
        chunks = list(one_step_per_item(gate, stream))
    assert len(chunks) > 3 and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_cache_salt_separates_prefix_caches(server, client, model):
    prompt = "A long shared system prompt that fills a few KV blocks of sixteen tokens each."

    def cached(**extra) -> int:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") > 0
    meta = lambda key: post(server, "/generate", {"text": prompt, "extra_key": key,  # noqa: E731
                                                  "sampling_params": {"max_new_tokens": 1}})["meta_info"]
    assert meta("sglang/a")["cached_tokens"] == 0 and meta("sglang/a")["cached_tokens"] > 0
    tito = lambda salt: post(server, "/inference/v1/generate", {  # noqa: E731
        "token_ids": list(prompt.encode()), "cache_salt": salt,
        "sampling_params": {"max_tokens": 1}})["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert tito("tito-salt") == 0 and tito("tito-salt") > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(cache_salt="a/b")


def test_truncate_prompt_tokens_keeps_the_last_k(client, model):
    ids = list(range(40, 100))
    r = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, extra_body={
        "truncate_prompt_tokens": 12, "return_token_ids": True, "routed_experts_prompt_start": 5, "ignore_eos": True})
    choice = r.choices[0]
    assert choice.prompt_token_ids == ids[-12:] and r.usage.prompt_tokens == 12
    assert decode_routed_experts(choice.routed_experts).shape[0] == 12 + 3 - 1 - 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=model, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": 10**6})


def test_top_logprobs_minus_one_follows_max_logprobs(client, model):
    with pytest.raises(openai.BadRequestError, match="max allowed: 20"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       logprobs=True, top_logprobs=-1)


def test_stop_token_text_is_left_out_unless_asked_for(client, model):
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    i, stop = next((i, t) for i, t in enumerate(free.token_ids) if 33 <= t < 127)
    for include in (False, True):
        c = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={
            "stop_token_ids": [stop], "include_stop_str_in_output": include}).choices[0]
        assert c.stop_reason == stop
        assert c.text == free.text[: i + 1] if include else c.text == free.text[:i]


def test_scoring_a_prompt_without_generating(server, client, model, offline):
    """vLLM's echo with max_tokens=0 and SGLang's max_new_tokens=0 (slime's teacher logprobs for
    on-policy distillation): the prompt's logprobs, nothing generated in the answer."""
    ids = list(PROMPT.encode())
    engine = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))[0].prompt_logprobs
    scored = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == PROMPT and "".join(lp.tokens) == PROMPT  # token ids echoed as text
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert all(math.isclose(a, e[t].logprob, abs_tol=1e-5) for a, e, t in zip(lp.token_logprobs[1:], engine[1:], ids[1:]))
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    out = post(server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    teacher = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]  # what slime reads
    assert len(teacher) == len(ids) - 1
    assert all(math.isclose(a, e[t].logprob, abs_tol=1e-5) for a, e, t in zip(teacher, engine[1:], ids[1:]))
    rows = decode_routed_experts(post(server, "/inference/v1/generate", {"token_ids": ids, "sampling_params": {
        "max_tokens": 1, **GREEDY}})["choices"][0]["routed_experts"])
    got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(len(ids) - 1, *rows.shape[1:])
    np.testing.assert_array_equal(got, rows[: len(ids) - 1].astype(np.int32))
