"""SGLang's own routed-experts and /generate tests, restated against `r3srv serve` on its built-in
model: `test/registered/rl/test_return_routed_experts.py` and `test/registered/core/test_srt_endpoint.py`
of sgl-project/sglang (read at commits 670c879f and 05f70dc5; SGLang's PyPI sdist ships no tests).
Their requests are sent as SGLang's tests send them, the rows decoded as SGLang's
`extract_routed_experts_from_meta_info` does (base64 of int32, reshaped to (-1, layers, top_k)).
SGLang's tests compare two servers (overlap, CUDA graphs and the radix cache off, then on); here
the same comparison is a cold request against its prefix-cached repeat and the three routes
against each other. Each test names the SGLang test it restates; docs/protocol.md lists the ones
left out and why."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from peer_ports import http, serve, topology  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.peer]

TEXTS = ["User: Tell me a fact about cats.\nAssistant:", "The capital of France is", "I have a very good idea on"]
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(topology):
    # SGLang's clients of the OpenAI routes read rows from `sglext`: the server flag that says so;
    # /flush_cache is one of the control routes, served with --enable-weight-updates
    yield from serve(topology, "--enable-return-routed-experts", "--routed-experts-encoding", "sglang", "--enable-weight-updates",
                     "--max-model-len", "256")


@pytest.fixture(scope="module")
def layout(http):
    return http.get("/v1/models").json()["data"][0]["routed_experts"]


def rows_of(b64: str, layout: dict) -> np.ndarray:
    """SGLang's extract_routed_experts_from_meta_info, then its tests' reshape."""
    return np.frombuffer(base64.b64decode(b64), dtype=np.int32).reshape(-1, layout["num_layers"], layout["top_k"])


def generate(http, **extra) -> httpx.Response:
    body = {"text": TEXTS[0], "return_routed_experts": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}}
    return http.post("/generate", json={**body, **extra})


def seqlen(out: dict) -> int:
    return out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"]


# ---------------------------------------------------------------- test_return_routed_experts.py

PAYLOADS = {  # TestReturnRoutedExperts._build_*_payload, with r3srv's few tokens
    "/generate": lambda text: {"text": text, "sampling_params": {"temperature": 0}, "return_routed_experts": True,
                               "max_new_tokens": MAX_NEW_TOKENS},
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}], "temperature": 0,
                                          "max_tokens": MAX_NEW_TOKENS, "return_routed_experts": True},
    "/v1/completions": lambda text: {"prompt": text, "temperature": 0, "max_tokens": MAX_NEW_TOKENS,
                                     "return_routed_experts": True},
}


def routed_experts(route: str, out: dict) -> str:
    """SGLang's extractors: meta_info on /generate, the response's sglext on the OpenAI routes."""
    return out["meta_info"]["routed_experts"] if route == "/generate" else out["sglext"]["routed_experts"]


def check_all_experts_id_valid(rows: np.ndarray, layout: dict) -> None:
    assert rows.min() >= 0 and rows.max() < layout["num_experts"]
    # compare_baseline_w_reference: no expert twice in one token's top-k
    assert all(len(set(topk)) == len(topk) for topk in rows.reshape(-1, layout["top_k"]).tolist())


@pytest.mark.parametrize("route", list(PAYLOADS))
def test_return_routed_experts(http, layout, route):
    """test_return_routed_experts.py::TestReturnRoutedExperts::test_return_routed_experts,
    test_return_routed_experts_chat_completions, test_return_routed_experts_completions: rows for
    every token but the last, valid ids, and the same rows from a repeat whose prompt comes from the
    prefix cache (SGLang's baseline/reference pair)"""
    with ThreadPoolExecutor(len(TEXTS)) as pool:  # SGLang's test sends its prompts concurrently
        cold = list(pool.map(lambda t: http.post(route, json=PAYLOADS[route](t)), TEXTS))
    warm = [http.post(route, json=PAYLOADS[route](t)) for t in TEXTS]
    for a, b in zip(cold, warm):
        assert a.status_code == b.status_code == 200, a.text + b.text
        rows = rows_of(routed_experts(route, a.json()), layout)
        usage = a.json()["meta_info"] if route == "/generate" else a.json()["usage"]
        assert rows.shape[0] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        check_all_experts_id_valid(rows, layout)
        assert np.array_equal(rows, rows_of(routed_experts(route, b.json()), layout))


def test_routes_agree(http, layout):
    """The routes give the same rows for the same tokens (SGLang's test reads each route with its
    own extractor; a route that shifted or dropped rows would differ here). SGLang's /generate
    payload puts max_new_tokens at the top level, which SGLang (and r3srv) ignore: it runs to the
    context, and the completion's 8 tokens are its prefix"""
    gen = http.post("/generate", json=PAYLOADS["/generate"](TEXTS[1])).json()
    comp = http.post("/v1/completions", json=PAYLOADS["/v1/completions"](TEXTS[1])).json()
    assert gen["meta_info"]["completion_tokens"] > MAX_NEW_TOKENS and gen["text"].startswith(comp["choices"][0]["text"])
    comp_rows = rows_of(routed_experts("/v1/completions", comp), layout)
    assert np.array_equal(rows_of(routed_experts("/generate", gen), layout)[:len(comp_rows)], comp_rows)


def test_start_len_zero_is_default(http, layout):
    """test_return_routed_experts.py::TestRoutedExpertsStartLen::test_start_len_zero_is_default"""
    default, zero = generate(http).json(), generate(http, routed_experts_start_len=0).json()
    assert seqlen(default) == seqlen(zero)
    rows_default = rows_of(default["meta_info"]["routed_experts"], layout)
    rows_zero = rows_of(zero["meta_info"]["routed_experts"], layout)
    assert rows_default.shape[0] == seqlen(default) - 1 and np.array_equal(rows_default, rows_zero)


def test_start_len_controls_row_count(http, layout):
    """test_return_routed_experts.py::TestRoutedExpertsStartLen::test_start_len_controls_row_count"""
    full = generate(http).json()
    full_rows = rows_of(full["meta_info"]["routed_experts"], layout)
    start = max(1, full["meta_info"]["prompt_tokens"] // 2)
    cropped = generate(http, routed_experts_start_len=start).json()
    cropped_rows = rows_of(cropped["meta_info"]["routed_experts"], layout)
    assert seqlen(cropped) == seqlen(full) and cropped_rows.shape[0] == seqlen(full) - 1 - start
    assert np.array_equal(full_rows[start:], cropped_rows)


def test_start_len_exceeds_prompt_tokens_aborts(http):
    """test_return_routed_experts.py::TestRoutedExpertsStartLen::test_start_len_exceeds_prompt_tokens_aborts:
    r3srv refuses it before it runs (a 400 naming the field) where SGLang aborts it; SGLang's own
    check (a status >= 400 and its phrase in the body) holds for both"""
    prompt_tokens = generate(http).json()["meta_info"]["prompt_tokens"]
    assert generate(http, routed_experts_start_len=prompt_tokens).status_code == 200
    too_big = generate(http, routed_experts_start_len=prompt_tokens + 1)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "routed_experts_start_len"
    assert "is higher than the number of input tokens" in too_big.text


def test_start_len_with_cache_hit(http, layout):
    """test_return_routed_experts.py::TestRoutedExpertsStartLen::test_start_len_with_cache_hit"""
    salt = "cache-hit-test"
    first = generate(http, extra_key=salt).json()
    assert first["meta_info"].get("cached_tokens", 0) == 0  # a cold miss: no other request used this key
    start = max(1, first["meta_info"]["prompt_tokens"] // 2)
    second = generate(http, extra_key=salt, routed_experts_start_len=start).json()
    assert second["meta_info"]["cached_tokens"] > start
    assert rows_of(second["meta_info"]["routed_experts"], layout).shape[0] == seqlen(second) - 1 - start


# ---------------------------------------------------------------- test_srt_endpoint.py


def test_logprob_start_len(http):
    """test_srt_endpoint.py::TestSRTEndpoint::test_logprob_start_len"""
    start, new_tokens = 4, 4
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    out = http.post("/generate", json={
        "text": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens},
        "return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": True,
        "logprob_start_len": start}).json()
    assert len(out) == len(prompts)
    for prompt, res in zip(prompts, out):
        meta = res["meta_info"]
        assert meta["prompt_tokens"] == start + len(meta["input_token_logprobs"])
        assert prompt.endswith("".join(x[-1] for x in meta["input_token_logprobs"]))
        assert meta["completion_tokens"] == new_tokens == len(meta["output_token_logprobs"])
        assert res["text"] == "".join(x[-1] for x in meta["output_token_logprobs"])


def test_logprob_with_long_prompt(http):
    """test_srt_endpoint.py::TestSRTEndpoint::test_logprob_with_chunked_prefill (a prompt near the
    context instead of SGLang's 8000 repeats; logprob_start_len -1: no input logprobs)"""
    new_tokens = 4
    out = http.post("/generate", json={
        "text": "I have a very good idea on this. " * 6,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens},
        "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 5}).json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == new_tokens
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == new_tokens
    for i in range(new_tokens):  # greedy: the top-1 is the sampled token
        assert meta["output_token_logprobs"][i] == meta["output_top_logprobs"][i][0]
        assert len(meta["output_top_logprobs"][i]) == 5


def test_logprob_match(http):
    """test_srt_endpoint.py::TestSRTEndpoint::test_logprob_match: sampled tokens' logprobs equal the
    prompt logprobs of a prefill-only rerun of the same tokens"""
    def run(prompt, max_new_tokens):
        key = "text" if isinstance(prompt, str) else "input_ids"
        return http.post("/generate", json={
            key: prompt, "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                             "sampling_seed": 7},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0}).json()

    gen = run("I have a very good idea on how to", 16)
    meta = gen["meta_info"]
    sampled = np.array([x[0] for x in meta["output_token_logprobs"]])
    tokens = [x[1] for x in meta["input_token_logprobs"]] + [x[1] for x in meta["output_token_logprobs"]]
    score = run(tokens, 0)["meta_info"]["input_token_logprobs"][meta["prompt_tokens"]:]
    # SGLang allows 0.35 between two GPU runs; one CPU model in float32 agrees to rounding
    assert np.abs(sampled - np.array([x[0] for x in score])).max() < 1e-3


@pytest.mark.parametrize("bias, check", [
    (100.0, lambda tokens, target: all(t == target for t in tokens)),
    (-100.0, lambda tokens, target: target not in tokens),
])
def test_logit_bias_and_forbidden_token(http, bias, check):
    """test_srt_endpoint.py::TestSRTEndpoint::test_logit_bias, test_forbidden_token, test_logit_bias_isolation"""
    target = http.post("/tokenize", json={"prompt": "P", "add_special_tokens": False}).json()["tokens"][0]

    def run(sampling):
        body = {"text": "The capital of France is PPP", "return_logprob": True,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 3, **sampling}}
        return [x[1] for x in http.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"]]

    with ThreadPoolExecutor(2) as pool:  # a batch: one with the bias, one without
        biased, plain = pool.map(run, [{"logit_bias": {str(target): bias}}, {}])
    assert check(biased, target)
    assert any(t != target for t in plain)  # isolation: the other request is not biased


def test_cache_tokens(http):
    """test_srt_endpoint.py::TestSRTEndpoint::test_cache_tokens, scaled to the context: cached
    tokens are the longest cached prefix, whole pages (r3srv's block), never the last token"""
    assert http.post("/flush_cache").status_code == 200
    page = http.get("/server_info").json().get("page_size") or 1

    def cached(n):
        body = {"input_ids": [(i * 7) % 250 + 1 for i in range(n)], "sampling_params": {"max_new_tokens": 1}}
        return http.post("/generate", json=body).json()["meta_info"]["cached_tokens"]

    def align_down(n):
        return n // page * page

    assert cached(40) == 0
    assert cached(200) == align_down(40)
    assert cached(200) == align_down(199)
    assert cached(100) == align_down(99)
    assert cached(220) == align_down(200)


def test_get_server_info(http):
    """test_srt_endpoint.py::TestSRTEndpoint::test_get_server_info, test_get_server_info_concurrent"""
    with ThreadPoolExecutor(4) as pool:
        infos = list(pool.map(lambda _: http.get("/server_info"), range(4)))
    for r in infos:
        assert r.status_code == 200
        assert isinstance(r.json()["max_total_num_tokens"], int) and isinstance(r.json()["version"], str)


@pytest.mark.parametrize("prompt", ["Hello SGLang world! 123 😊, ಪರ್ವತದ ಮೇಲೆ ಹಿಮ.", ""])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_various_inputs(http, prompt, add_special_tokens):
    """test_srt_endpoint.py::TestTokenizeDetokenize::test_tokenize_various_inputs (its list-of-prompts
    cases: /tokenize is vLLM's shape on r3srv, see test_tokenize_prompt_list_is_vllms_400)"""
    r = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": add_special_tokens})
    assert r.status_code == 200, r.text
    assert len(r.json()["tokens"]) == r.json()["count"] and (r.json()["count"] == 0) == (prompt == "")


def test_tokenize_prompt_list_is_vllms_400(http):
    """SGLang's /tokenize also takes a list of prompts; vLLM's (the same path) takes one string, and
    r3srv serves vLLM's: the list is a 400 naming `prompt` (docs/protocol.md)"""
    r = http.post("/tokenize", json={"prompt": ["First sentence.", "Second, with 中文."]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_tokenize_invalid_type(http):
    """test_srt_endpoint.py::TestTokenizeDetokenize::test_tokenize_invalid_type"""
    assert http.post("/tokenize", json={"prompt": 12345}).status_code == 400


def test_tokenize_chat_messages(http):
    """test_srt_endpoint.py::TestTokenizeDetokenize::test_openai_tokenize_chat_messages, on /tokenize
    (r3srv does not serve SGLang's /v1/tokenize alias); the oracle is the prompt /v1/chat/completions
    renders, as SGLang's is its tokenizer's chat template"""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = http.post("/tokenize", json={"messages": messages}).json()
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert resp["tokens"] == chat.json()["prompt_token_ids"] and resp["count"] == len(resp["tokens"])


def test_detokenize_roundtrip(http):
    """test_srt_endpoint.py::TestTokenizeDetokenize::test_detokenize_roundtrip (the text is under
    vLLM's key `prompt`; SGLang's is `text`)"""
    text = "Verify detokenization round trip. यह डिटोकेनाइजेशन है"
    tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == text


def test_stream_ends_with_done(http):
    """test_srt_endpoint.py::TestSRTEndpoint::run_decode(stream=True), the stream its tests parse:
    `data: ` lines of JSON, then `data: [DONE]`; the last carries the whole text (SGLang's cumulative stream)"""
    body = {"text": TEXTS[1], "stream": True, "return_logprob": True, "top_logprobs_num": 5,
            "return_text_in_logprobs": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    with http.stream("POST", "/generate", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    plain = http.post("/generate", json={**body, "stream": False}).json()
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
