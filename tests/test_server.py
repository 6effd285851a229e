"""End-to-end tests of `r3srv serve` (the built-in model on CPU) with the real openai SDK and httpx.

One server per module, started with --enable-return-routed-experts. Routed experts
are decoded the way clients do it, `np.load(io.BytesIO(base64.b64decode(s)))`,
and their shape is checked against the returned token ids:
rows = len(prompt_token_ids) + len(token_ids) - 1 - routed_experts_prompt_start.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # real servers

MAX_BODY = 200_000


@pytest.fixture(scope="module")
def server(gate):
    with RemoteServer(
        "--enable-return-routed-experts", "--max-request-body-bytes", str(MAX_BODY), "--enable-prompt-tokens-details",
        *TEST_SERVER_ARGS, step_gate=gate,
    ) as srv:
        yield srv
    assert srv.returncode == 0, f"SIGTERM should stop the server cleanly:\n{srv.log}"


@pytest.fixture(scope="module")
def model_info(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    return card


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(model_info):
    return model_info["id"]


def decode(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)))


def check_experts(s: str, prompt_ids: list[int], token_ids: list[int], start: int, info: dict) -> np.ndarray:
    re_info = info["routed_experts"]
    arr = decode(s)
    assert arr.shape == (len(prompt_ids) + len(token_ids) - 1 - start, re_info["num_layers"], re_info["top_k"])
    assert arr.dtype == np.dtype(re_info["dtype"])
    assert int(arr.max()) < re_info["num_experts"]
    # top-k ids of one token at one layer are distinct
    assert all(len(set(row.tolist())) == re_info["top_k"] for row in arr.reshape(-1, re_info["top_k"]))
    return arr


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)}\s+(\S+)$", re.M)
    match = pattern.search(text)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def wait_blocks_free(server, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    used = metric(server, "r3srv_kv_blocks_used")
    while used > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        used = metric(server, "r3srv_kv_blocks_used")
    return used


# ---------------------------------------------------------------- discovery


def test_models_health_version(server, model_info):
    assert model_info["object"] == "model"
    re_info = model_info["routed_experts"]
    assert set(re_info) == {"num_layers", "top_k", "num_experts", "dtype", "moe_layers"}
    assert all(0 <= i < re_info["num_layers"] for i in re_info["moe_layers"])
    assert model_info["max_model_len"] > 0
    assert httpx.get(server.url + "/health").status_code == 200
    version = httpx.get(server.url + "/version").json()["version"]
    import r3srv

    assert version == r3srv.__version__


def test_openapi_schema_lists_routes(server):
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/tokenize"):
        assert path in schema["paths"]
    assert "routed_experts_prompt_start" in json.dumps(schema["components"])
    # The server embeds the text pre-quoted (msgspec.Raw); the documented type stays string.
    for name in ("CompletionResponseChoice", "ChatCompletionResponseChoice", "GenerateChoice"):
        field = schema["components"]["schemas"][name]["properties"]["routed_experts"]
        assert {"type": "string"} in field["oneOf"], (name, field)


def _bounds(rule: dict, path: str = "") -> set[tuple[str, str, str, float]]:
    """(path, JSON type, keyword, value) of every bound in a JSON schema node, unions flattened and
    array items followed (`path` grows by "[]"); references are other components."""
    members = rule.get("anyOf") or rule.get("oneOf")
    if members:
        return {b for member in members for b in _bounds(member, path)}
    kinds = rule.get("type")
    found = set()
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                        "minItems", "maxItems"):
            if keyword in rule:
                found.add((path, kind, keyword, float(rule[keyword])))
    if isinstance(rule.get("items"), dict):
        found |= _bounds(rule["items"], path + "[]")
    return found


def test_published_request_fields_carry_the_bounds_their_bodies_are_decoded_by(server):
    import msgspec

    from r3srv.server.openapi_bounds import body_types
    from r3srv.server.routes import ROUTE_HANDLERS

    # msgspec's own schema of every route's body type: the rules the server decodes bodies by
    _, enforced = msgspec.json.schema_components(body_types(ROUTE_HANDLERS))
    published = httpx.get(server.url + "/schema/openapi.json").json()["components"]["schemas"]
    missing, checked = [], 0
    for name, component in enforced.items():
        assert name in published, f"{name} is not a published component"
        for field, rule in component.get("properties", {}).items():
            want = _bounds(rule)
            checked += len(want)
            have = _bounds(published[name]["properties"][field])
            missing += [f"{name}.{field}: {b}" for b in sorted(want - have)]
    assert checked >= 40 and not missing, "\n".join(missing)
    # the bounds Litestar used to drop (in a list, in a union), and the server refusing what they exclude
    tokens = published["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"]["minimum"] == 0, tokens
    refused = httpx.post(server.url + "/detokenize", json={"tokens": [1, -1]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens", refused.text
    top = published["SglangGenerateRequest"]["properties"]["top_logprobs_num"]
    assert {"type": "integer", "maximum": 20} in [{k: b[k] for k in ("type", "maximum") if k in b}
                                                   for b in top["oneOf"]], top
    body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}
    refused = httpx.post(server.url + "/generate", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs_num", refused.text


def test_tokenize_detokenize_roundtrip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == "hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 2


# ---------------------------------------------------------------- completions and chat


@pytest.mark.parametrize("start", [0, 3, "prompt_len"])
def test_completion_routed_experts(client, model, model_info, start):
    prompt = "The quick brown fox"
    start = len(prompt.encode()) if start == "prompt_len" else start  # the built-in tokenizer is byte-level
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_body={"routed_experts_prompt_start": start, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert len(choice.token_ids) == 5 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(choice.prompt_token_ids)
    check_experts(choice.routed_experts, choice.prompt_token_ids, choice.token_ids, start, model_info)


def test_prompt_start_slices_the_same_rows(client, model):
    kwargs = dict(model=model, prompt="abcdefgh", max_tokens=3, temperature=0)
    full = decode(client.completions.create(**kwargs).choices[0].routed_experts)
    tail = decode(client.completions.create(**kwargs, extra_body={"routed_experts_prompt_start": 5}).choices[0].routed_experts)
    np.testing.assert_array_equal(full[5:], tail)


def test_multi_turn_start_continues_the_rows_already_held(server, client, model, model_info):
    """docs/rl.md's multi-turn recipe: turn 2 asks from the count of rows turn 1 returned, and the two
    arrays together cover every token of turn 2 but the last; turn 1's blocks come from the cache."""
    kwargs = dict(model=model, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    turn1 = client.completions.create(prompt="Multi-turn agents hold rows. " * 2, **kwargs).choices[0]
    rows1 = check_experts(turn1.routed_experts, turn1.prompt_token_ids, turn1.token_ids, 0, model_info)
    prompt2 = turn1.prompt_token_ids + turn1.token_ids + list(b" Next turn:")
    hits = metric(server, "r3srv_prefix_cache_hits_total")
    body = dict(kwargs["extra_body"], routed_experts_prompt_start=len(rows1))
    response2 = client.completions.create(model=model, prompt=prompt2, max_tokens=6, temperature=0, extra_body=body)
    turn2 = response2.choices[0]
    rows2 = check_experts(turn2.routed_experts, turn2.prompt_token_ids, turn2.token_ids, len(rows1), model_info)
    assert turn2.prompt_token_ids == prompt2
    assert len(rows1) + len(rows2) == len(prompt2) + len(turn2.token_ids) - 1
    reused = metric(server, "r3srv_prefix_cache_hits_total") - hits
    assert reused >= 32  # turn 1's full blocks were reused
    assert response2.usage.prompt_tokens_details.cached_tokens == reused  # and the usage says so (OpenAI's field)


def test_completion_n_choices_each_full_array(client, model, model_info):
    r = client.completions.create(
        model=model, prompt="Once upon", max_tokens=4, n=3, temperature=1.0, seed=7, extra_body={"return_token_ids": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        check_experts(c.routed_experts, c.prompt_token_ids, c.token_ids, 0, model_info)
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)


def test_completion_batch_of_prompts(client, model, model_info):
    r = client.completions.create(
        model=model, prompt=["ab", "cdef"], max_tokens=2, n=2, temperature=0, extra_body={"return_token_ids": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.prompt_token_ids == list((b"ab" if c.index < 2 else b"cdef"))
        check_experts(c.routed_experts, c.prompt_token_ids, c.token_ids, 0, model_info)


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="xyz", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and val == pytest.approx(max(top.values()))  # greedy: the sampled token is the best


def test_chat_completion(client, model, model_info):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "routed_experts_prompt_start": 2},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    prompt_ids = r.model_extra["prompt_token_ids"]
    check_experts(choice.routed_experts, prompt_ids, choice.token_ids, 2, model_info)
    templated = httpx.post(
        str(client.base_url).replace("/v1/", "/tokenize"), json={"messages": [{"role": "user", "content": "Say hi"}]}
    ).json()["tokens"]
    assert prompt_ids == templated


def test_return_routed_experts_false_opts_out(client, model):
    r = client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"return_routed_experts": False})
    assert r.choices[0].routed_experts is None


# ---------------------------------------------------------------- streaming


def test_stream_completion_matches_non_streaming(client, model, model_info):
    kwargs = dict(model=model, prompt="Streaming test", max_tokens=6, temperature=0)
    extra = {"return_token_ids": True, "routed_experts_prompt_start": 1}
    ref = client.completions.create(**kwargs, extra_body=extra).choices[0]
    text, tokens, experts, finals, usage = "", [], [], 0, None
    prompt_ids = None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            tokens += c.token_ids or []
            prompt_ids = prompt_ids or getattr(c, "prompt_token_ids", None)
            if c.finish_reason is not None:
                finals += 1
                experts.append(c.routed_experts)
            else:
                assert getattr(c, "routed_experts", None) is None, "only the final chunk carries routed experts"
    assert finals == 1 and text == ref.text and tokens == ref.token_ids and prompt_ids == ref.prompt_token_ids
    assert usage.completion_tokens == len(tokens) and usage.prompt_tokens == len(prompt_ids)
    arr = check_experts(experts[0], prompt_ids, tokens, 1, model_info)
    np.testing.assert_array_equal(arr, decode(ref.routed_experts))


def test_stream_chat_n2(client, model, model_info):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        n=2,
        seed=3,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    tokens: dict[int, list[int]] = {0: [], 1: []}
    experts: dict[int, str] = {}
    prompt_ids = None
    roles = set()
    for chunk in stream:
        prompt_ids = prompt_ids or chunk.model_extra.get("prompt_token_ids")
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            tokens[c.index] += getattr(c, "token_ids", None) or []
            if c.finish_reason:
                experts[c.index] = c.routed_experts
    assert roles == {0, 1} and set(experts) == {0, 1}
    for i in (0, 1):
        check_experts(experts[i], prompt_ids, tokens[i], 0, model_info)


def test_stream_sse_wire_format(server, model):
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={"model": model, "prompt": "ab", "max_tokens": 2, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


# ---------------------------------------------------------------- /inference/v1/generate and abort


def test_generate_tokens(server, model_info):
    # shorter than one KV block, so the streamed rerun recomputes the same prefill (no prefix-cache hit
    # changing the batch shape, and with it the float rounding of near-tied router scores)
    prompt = list(range(40, 52))
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 4, "temperature": 0, "routed_experts_prompt_start": 7},
        "return_token_ids": True,
    }
    r = httpx.post(server.url + "/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert out["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 4
    check_experts(choice["routed_experts"], prompt, choice["token_ids"], 7, model_info)

    # the same request streamed: token deltas add up, the final chunk has the same rows
    tokens, final = [], None
    with httpx.stream("POST", server.url + "/inference/v1/generate", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    tokens += c["token_ids"]
                    if c["finish_reason"]:
                        final = c["routed_experts"]
    assert tokens == choice["token_ids"]
    np.testing.assert_array_equal(decode(final), decode(choice["routed_experts"]))


def test_generate_bad_offset_names_field_value_and_length(server):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 4}}
    r = httpx.post(server.url + "/inference/v1/generate", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "routed_experts_prompt_start"
    assert "routed_experts_prompt_start" in err["message"] and "4" in err["message"] and "3" in err["message"]


def test_abort_requests_ends_generation(server, gate):
    body = {"token_ids": [5, 6, 7], "request_id": "abort-me", "stream": True, "sampling_params": {"max_tokens": 3000, "ignore_eos": True}}
    finish = None
    with gate.allowing(2), httpx.stream("POST", server.url + "/inference/v1/generate", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break  # generation is running
        r = httpx.post(server.url + "/inference/v1/abort_requests", json={"request_ids": ["abort-me"]})
        assert r.status_code == 200
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    finish = c["finish_reason"] or finish
    assert finish == "abort"
    assert wait_blocks_free(server) == 0


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("start", [-1, 10_000])
def test_bad_offset_is_bad_request(client, model, start):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="hello", max_tokens=2, extra_body={"routed_experts_prompt_start": start})
    assert "routed_experts_prompt_start" in exc.value.message
    if start > 0:
        assert str(start) in exc.value.message and "5" in exc.value.message  # value and prompt length


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_prompt_too_long_is_bad_request(client, model, model_info):
    too_long = [65] * (model_info["max_model_len"] + 1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=too_long, max_tokens=1)


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["code"] == r.status_code
    return body["error"]


# Bodies no POST route accepts: broken JSON, wrong top-level types, hostile nesting.
MALFORMED_ANYWHERE = [
    b"",
    b"not json",
    b"{",
    b'{"prompt": "x"',
    b"\xff\xfe\x00garbage",
    b"null",
    b"[]",
    b"[1, 2, 3]",
    b'"a string"',
    b"12",
    b"{}",
    b"[" * 5000 + b"]" * 5000,
    b'{"a": ' * 3000 + b"1" + b"}" * 3000,
]
# Well-formed JSON objects with missing fields, wrong types or values out of range, per route.
_MSG = [{"role": "user", "content": "x"}]
INVALID_PER_ROUTE: dict[str, list[dict]] = {
    "/v1/completions": [
        {"prompt": 5},
        {"prompt": None},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [1, "a"]},
        {"prompt": [-1]},
        {"prompt": [1.5]},
        {"prompt": [99999999999999999999]},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "n": 10_000},
        {"prompt": "x", "n": "two"},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": -3},
        {"prompt": "x", "max_tokens": 1e400},
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "logprobs": 99},
        {"prompt": "x", "stop": [""]},
        {"prompt": "x", "stream": "maybe"},
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "routed_experts_prompt_start": -1},
        {"prompt": "x", "routed_experts_prompt_start": 2},
        {"prompt": "x", "routed_experts_prompt_start": "zero"},
        {"prompt": "x", "return_routed_experts": "maybe"},  # "yes" is true, as pydantic reads it
        {"prompt": "x", "model": "nope"},
        {"prompt": "x", "presence_penalty": 2.5},
        {"prompt": "x", "logit_bias": {"not-an-id": 1}},
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        {"prompt": [65] * 5000},
        {"prompt": "x", "seed": "s"},
    ],
    "/v1/chat/completions": [
        {"messages": None},
        {"messages": []},
        {"messages": [{}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": _MSG, "n": 0},
        {"messages": _MSG, "max_tokens": 0},
        {"messages": _MSG, "max_completion_tokens": -1},
        {"messages": _MSG, "temperature": -0.5},
        {"messages": _MSG, "logprobs": "maybe"},
        {"messages": _MSG, "top_logprobs": 5},
        {"messages": _MSG, "top_logprobs": 50, "logprobs": True},
        {"messages": _MSG, "routed_experts_prompt_start": -1},
        {"messages": _MSG, "routed_experts_prompt_start": 10_000},
        {"messages": _MSG, "model": "nope"},
        {"messages": _MSG, "stream_options": {"include_usage": 3}, "stream": True},
    ],
    "/inference/v1/generate": [
        {"token_ids": [1]},
        {"sampling_params": {}},
        {"token_ids": [], "sampling_params": {}},
        {"token_ids": [-5], "sampling_params": {}},
        {"token_ids": ["a"], "sampling_params": {}},
        {"token_ids": [1], "sampling_params": []},
        {"token_ids": [1], "sampling_params": None},
        {"token_ids": [1], "sampling_params": {"n": 0}},
        {"token_ids": [1], "sampling_params": {"n": 100_000}},
        {"token_ids": [1], "sampling_params": {"temperature": -1}},
        {"token_ids": [1], "sampling_params": {"top_p": 0}},
        {"token_ids": [1], "sampling_params": {"max_tokens": -3}},
        {"token_ids": [1], "sampling_params": {"logprobs": 99}},
        {"token_ids": [1], "sampling_params": {"stop": [""]}},
        {"token_ids": [1], "sampling_params": {"seed": "s"}},
        {"token_ids": [1], "sampling_params": {"routed_experts_prompt_start": -1}},
        {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}},
        {"token_ids": [99999999999], "sampling_params": {}},
        {"token_ids": [1], "sampling_params": {}, "model": "nope"},
        {"token_ids": [1], "sampling_params": {}, "output_mode": "derender"},
        {"token_ids": [1] * 5000, "sampling_params": {}},
    ],
    "/inference/v1/abort_requests": [{"request_ids": None}, {"request_ids": "a"}, {"request_ids": [1]}, {"ids": []}],
    "/tokenize": [{"prompt": 5}, {"prompt": "a", "messages": _MSG}, {"messages": [{"role": 1}]}, {"prompt": "x", "model": "nope"}],
    "/detokenize": [{"tokens": [-1]}, {"tokens": ["a"]}, {"tokens": [99999999999]}, {"tokens": None}, {"tokens": [1.5]}],
}


@pytest.mark.parametrize("route", list(INVALID_PER_ROUTE))
def test_malformed_bodies_get_openai_errors(server, route):
    bodies = MALFORMED_ANYWHERE + [json.dumps(b).encode() for b in INVALID_PER_ROUTE[route]]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body in bodies:
            r = http.post(route, content=body, headers={"content-type": "application/json"})
            try:
                assert_openai_error(r)
            except AssertionError as exc:
                raise AssertionError(f"{route} {body[:120]!r}: {exc}") from None
    assert 'status="500"' not in httpx.get(server.url + "/metrics").text, "no request content may produce a 500"


def test_wrong_type_error_names_the_field(server, model):
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": "many"})
    err = assert_openai_error(r, 400)
    assert err["param"] == "max_tokens" and "max_tokens" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": model})
    assert "prompt" in assert_openai_error(r, 400)["message"]


def test_body_too_large_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * MAX_BODY + b'"}')
    assert_openai_error(r, 413)


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)


def test_out_of_range_sampling_fields_are_refused(client, model):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, presence_penalty=2.5)


# ---------------------------------------------------------------- concurrency, disconnects, metrics


def test_concurrent_clients_get_their_own_results(server, model):
    """Requests from many clients batch together; greedy results match the one-at-a-time ones."""
    prompts = [f"client {i} says" for i in range(6)]
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    expected = [sync.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(
            *(aclient.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts)
        )
        await aclient.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == expected


def _wait_blocks_in_use(server) -> None:
    deadline = time.monotonic() + 30
    while metric(server, "r3srv_kv_blocks_used") == 0:
        assert time.monotonic() < deadline, "the long request never showed up in the KV pool"
        time.sleep(0.02)
    assert metric(server, "r3srv_num_requests_running") >= 1


def test_stream_disconnect_frees_blocks(server, gate):
    assert wait_blocks_free(server) == 0
    body = {"prompt": "x" * 300, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with gate.allowing(2), httpx.Client(timeout=60) as http:  # in flight until the client goes
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # keep a reference: dropping the iterator closes the connection
            assert next(line for line in lines if line.startswith("data: "))
            _wait_blocks_in_use(server)
            r.close()  # the client goes away mid-stream
            del lines
    assert wait_blocks_free(server) == 0, "a disconnected stream must free its KV blocks"
    assert metric(server, "r3srv_num_requests_running") == 0


def test_non_stream_disconnect_frees_blocks(server, gate):
    assert wait_blocks_free(server) == 0
    body = {"prompt": "y" * 300, "max_tokens": 3000, "ignore_eos": True}

    async def run() -> None:
        gate.allow(2)  # in flight until the client hangs up
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(server.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while metric(server, "r3srv_kv_blocks_used") == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            task.cancel()  # the client gives up: httpx closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    try:
        asyncio.run(run())
    finally:
        gate.open()
    assert wait_blocks_free(server) == 0, "a client that hangs up must free its KV blocks"


def test_metrics_count_requests_tokens_and_bytes(server, client, model):
    before = metric(server, "r3srv_routed_experts_bytes_total")
    gen_before = metric(server, "r3srv_generation_tokens_total")
    r = client.completions.create(model=model, prompt="metrics", max_tokens=3)
    assert metric(server, "r3srv_routed_experts_bytes_total") - before == len(r.choices[0].routed_experts)
    assert metric(server, "r3srv_generation_tokens_total") - gen_before == 3
    assert metric(server, "r3srv_requests_total", '{route="/v1/completions",status="200"}') >= 1
    with pytest.raises(openai.BadRequestError):  # counted by status too (this test's own 400: no order dependence)
        client.completions.create(model=model, prompt="metrics", max_tokens=3, extra_body={"routed_experts_prompt_start": 10**6})
    assert metric(server, "r3srv_requests_total", '{route="/v1/completions",status="400"}') >= 1
    assert metric(server, "r3srv_e2e_request_latency_seconds_count", '{route="/v1/completions"}') >= 1
    assert metric(server, "r3srv_time_to_first_token_seconds_count", '{route="/v1/completions"}') >= 1
    assert metric(server, "r3srv_kv_blocks_total") == 256


def test_stop_string_trims_text_tokens_and_rows_alike(client, model, model_info):
    base = dict(model=model, prompt="stop here:", temperature=0)
    free = client.completions.create(**base, max_tokens=12).choices[0].text
    # a 2-character stop string that first occurs at some i >= 3 of the greedy text
    cut = next(i for i in range(3, len(free) - 2) if free[i : i + 2].strip() and free[i : i + 2] not in free[: i + 1])
    stop = free[cut : cut + 2]
    extra = {"return_token_ids": True}
    ref = client.completions.create(**base, max_tokens=12, stop=[stop], extra_body=extra).choices[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == stop and ref.text == free[:cut]
    check_experts(ref.routed_experts, ref.prompt_token_ids, ref.token_ids, 0, model_info)
    text, tokens, final = "", [], None
    for chunk in client.completions.create(**base, max_tokens=12, stop=[stop], stream=True, extra_body=extra):
        for c in chunk.choices:
            text += c.text
            tokens += c.token_ids or []
            final = c if c.finish_reason else final
    assert (text, tokens, final.finish_reason) == (ref.text, ref.token_ids, "stop")
    np.testing.assert_array_equal(decode(final.routed_experts), decode(ref.routed_experts))


def test_clients_batch_together_and_all_disconnects_free_blocks(server, gate):
    """Three clients stream at once: the engine runs them in the same steps; hanging up frees everything."""
    assert wait_blocks_free(server) == 0
    body = {"max_tokens": 3000, "ignore_eos": True, "stream": True}
    with gate.allowing(0), httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(3) as pool:
        opening = [pool.submit(http.send, http.build_request("POST", server.url + "/v1/completions",
                                                             json={**body, "prompt": f"client {i}"}), stream=True)
                   for i in range(3)]
        deadline = time.monotonic() + 30
        while metric(server, "r3srv_num_requests_waiting") < 3:  # all three in, no step taken
            assert time.monotonic() < deadline, "the three requests never reached the engine"
            time.sleep(0.02)
        gate.allow(2)  # the three prefilled in one step, one decode step, then held in flight
        responses = [f.result(timeout=60) for f in opening]
        iters = [r.iter_lines() for r in responses]  # keep them: dropping one closes its connection
        for lines in iters:
            assert next(line for line in lines if line.startswith("data: "))
        assert metric(server, "r3srv_num_requests_running") == 3
        for r in responses:
            r.close()
        del iters
    assert wait_blocks_free(server) == 0
    assert metric(server, "r3srv_num_requests_running") == 0


def test_event_loop_stays_responsive_during_generation(server, gate):
    """The engine steps on its own thread: /health answers while a long request runs. The request
    (a 1500-token prefill, then decode steps) cannot finish before the gate opens, which is after
    ten /health answers: a loop the request blocked would answer none (the probe times out)."""
    result: dict = {}

    def long_request() -> None:
        body = {"prompt": "z" * 1500, "max_tokens": 150, "ignore_eos": True}
        result["status"] = httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code

    with gate.allowing(20):
        thread = threading.Thread(target=long_request)
        thread.start()
        for _ in range(10):
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            assert "status" not in result  # still in flight
            time.sleep(0.01)
    thread.join()
    assert result["status"] == 200
