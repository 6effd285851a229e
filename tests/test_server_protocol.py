"""The wire Structs alone (no server): decoding, validation and the one road to SamplingParams."""

from __future__ import annotations

import msgspec
import pytest

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams
from r3srv.server import protocol as p
from r3srv.server.errors import error_body


def decode(cls, obj):
    return msgspec.json.decode(msgspec.json.encode(obj), type=cls)


def test_completion_request_maps_every_field():
    req = decode(
        p.CompletionRequest,
        {
            "model": "m", "prompt": "hi", "max_tokens": 7, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
            "seed": 11, "stop": "END", "logprobs": 3, "min_tokens": 1, "stop_token_ids": [5], "ignore_eos": True,
            "skip_special_tokens": False, "include_stop_str_in_output": True, "routed_experts_prompt_start": 1,
            "return_routed_experts": False, "return_token_ids": True, "unknown_field": "ignored",
        },
    )
    sp = req.to_sampling_params()
    assert sp == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=4, seed=11, max_tokens=7, min_tokens=1, stop=["END"],
        stop_token_ids=[5], ignore_eos=True, logprobs=3, skip_special_tokens=False, include_stop_str_in_output=True,
        routed_experts_prompt_start=1, return_routed_experts=False, return_sampling_mask=False,
    )


def test_completion_defaults_follow_openai():
    sp = decode(p.CompletionRequest, {"prompt": "x"}).to_sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.return_routed_experts) == (16, 1.0, 1.0, 1, None)
    assert sp.routed_experts_prompt_start == 0


@pytest.mark.parametrize(
    "prompt, expected",
    [("ab", ["ab"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, expected):
    assert decode(p.CompletionRequest, {"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], ["a", [1]]])
def test_bad_prompt_forms(prompt):
    with pytest.raises(InvalidRequestError) as exc:
        decode(p.CompletionRequest, {"prompt": prompt}).prompts()
    assert exc.value.param == "prompt"


def test_chat_request_maps_tokens_and_logprobs():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = decode(p.ChatCompletionRequest, {"messages": msgs, "max_tokens": 9, "max_completion_tokens": 4,
                                          "logprobs": True, "top_logprobs": 2})
    sp = req.to_sampling_params()
    assert sp.max_tokens == 4 and sp.logprobs == 2  # max_completion_tokens wins, as in OpenAI
    assert req.template_messages() == [{"role": "user", "content": "ab"}]
    assert decode(p.ChatCompletionRequest, {"messages": msgs}).to_sampling_params().max_tokens is None
    assert decode(p.ChatCompletionRequest, {"messages": msgs}).to_sampling_params().logprobs is None


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (p.CompletionRequest, {"prompt": "x", "temperature": -1}, "temperature"),
        (p.CompletionRequest, {"prompt": "x", "top_p": 2}, "top_p"),
        (p.CompletionRequest, {"prompt": "x", "stop": [""]}, "stop"),
        (p.CompletionRequest, {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
        (p.CompletionRequest, {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
        (p.CompletionRequest, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (p.CompletionRequest, {"prompt": "x", "min_p": 1.5}, "min_p"),
        (p.CompletionRequest, {"prompt": "x", "logit_bias": {"1.5": 2}}, "logit_bias"),
        (p.CompletionRequest, {"prompt": "x", "logprobs": -2}, "logprobs"),
        (p.CompletionRequest, {"prompt": "x", "prompt_logprobs": -3}, "prompt_logprobs"),
        (p.CompletionRequest, {"prompt": "x", "prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
        (p.CompletionRequest, {"prompt": "x", "cache_salt": "x" * 129}, "cache_salt"),
        (p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "top_logprobs"),
        (p.CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_values_name_their_field(cls, body, param):
    with pytest.raises(InvalidRequestError) as exc:
        decode(cls, body).to_sampling_params()
    assert exc.value.param == param and param in str(exc.value)


@pytest.mark.parametrize(
    "cls, body",
    [
        (p.CompletionRequest, {"prompt": "x", "routed_experts_prompt_start": -1}),
        (p.CompletionRequest, {"prompt": "x", "n": 0}),
        (p.ChatCompletionRequest, {"messages": []}),
        (p.GenerateRequest, {"token_ids": [], "sampling_params": {}}),
        (p.GenerateRequest, {"token_ids": [-1], "sampling_params": {}}),
        (p.GenerateRequest, {"token_ids": [1], "sampling_params": {"routed_experts_prompt_start": -2}}),
        # the OpenAI routes' cap on n holds here too (n=100000 tied the engine up for minutes)
        (p.GenerateRequest, {"token_ids": [1], "sampling_params": {"n": 129}}),
        (p.GenerateRequest, {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}, "stream": True}),
        (p.CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": -2}),
        (p.DetokenizeRequest, {"tokens": [-1]}),
    ],
)
def test_constraints_reject_at_decode(cls, body):
    with pytest.raises(msgspec.ValidationError):
        decode(cls, body)


def test_generate_request_decodes_sampling_params_directly():
    req = decode(
        p.GenerateRequest,
        {"token_ids": [3, 4], "sampling_params": {"max_tokens": 5, "routed_experts_prompt_start": 1, "n": 2}},
    )
    assert isinstance(req.sampling_params, SamplingParams)
    assert req.sampling_params.routed_experts_prompt_start == 1 and req.sampling_params.n == 2
    assert (req.stream, req.output_mode, req.request_id) == (False, "tokens", msgspec.UNSET)  # null is refused


def test_vllm_null_fields_are_sent_as_null():
    # vLLM sends these keys as null when not asked for: SDK objects read them as attributes
    choice = msgspec.to_builtins(p.CompletionResponseChoice(index=0, text="a"))
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["prompt_logprobs"] is None
    assert "weight_version" not in choice  # r3srv's own: only where weights can change
    choice = p.CompletionResponseChoice(index=0, text="a", token_ids=[1], prompt_token_ids=[2])
    assert msgspec.to_builtins(choice)["token_ids"] == [1]


def test_error_body_shape():
    body = msgspec.to_builtins(error_body(404, "nope", "model"))
    assert body == {"error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}}
    assert msgspec.to_builtins(error_body(413, "big"))["error"]["type"] == "RequestEntityTooLargeError"


@pytest.mark.parametrize("name", ["cache_salt", "extra_key"])
@pytest.mark.parametrize("text", ["one prompt", ["a"], ["a", "b"]], ids=["single", "batch of 1", "batch of 2"])
@pytest.mark.parametrize("salt", ["s", "", [], ["s"], ["s", ""], ["s", "t", "u"]], ids=repr)
def test_sglang_salts_follow_sglangs_normalization(name, text, salt):
    """SGLang 0.5.23's GenerateReqInput: a string for one request or for all of a batch ("" is none);
    a list only for a batch, one entry per prompt; anything else a ValueError (400), never an IndexError."""
    request = decode(p.SglangGenerateRequest, {"text": text, name: salt})
    batch = isinstance(text, list)
    if isinstance(salt, list) and (not batch or len(salt) != len(text)):
        with pytest.raises(InvalidRequestError) as err:
            request.prompts()
        assert err.value.param == name
        return
    salts = [request.to_sampling_params(i).cache_salt for i in range(len(request.prompts()))]
    given = salt if isinstance(salt, list) else [salt] * len(salts)
    assert [s is None for s in salts] == [not g for g in given]  # "" is no salt
    assert len({s for s, g in zip(salts, given) if g}) == len({g for g in given if g})  # distinct stay distinct
