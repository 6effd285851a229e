"""SGLang's native POST /generate on a real server (the built-in model, routed experts on):
routed experts decoded the way SGLang-based trainers (slime, miles) decode them,
`np.frombuffer(b64decode(s), np.int32).reshape(len(tokens) - 1, num_layers, top_k)`, equal to
the same request's rows through vLLM's /inference/v1/generate; SGLang's finish reasons,
logprobs and n; unsupported fields are 400s that name them."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from r3srv.serial import decode_routed_experts

pytestmark = pytest.mark.slow  # real servers

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def server(gate):
    with RemoteServer("--enable-return-routed-experts", *TEST_SERVER_ARGS, step_gate=gate) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def layout(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["routed_experts"]


def generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def sglang_rows(meta: dict, tokens: int, layout: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(
        tokens - 1, layout["num_layers"], layout["top_k"])


@pytest.mark.parametrize("start", [0, 5])
def test_input_ids_and_rows_as_sglang_clients_read_them(server, layout, start):
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    r = generate(server, {"input_ids": PROMPT, "sampling_params": params, "return_routed_experts": True,
                          "routed_experts_start_len": start, "rid": "sg-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 6 and isinstance(out["text"], str)
    assert meta["id"] == "sg-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 6)
    rows = sglang_rows(meta, len(PROMPT) + len(ids) - start, layout)
    vllm = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                                                 "routed_experts_prompt_start": start}}).json()["choices"][0]
    assert vllm["token_ids"] == ids
    np.testing.assert_array_equal(rows, decode_routed_experts(vllm["routed_experts"]).astype(np.int32))


def test_text_logprobs_stop_and_n(server, layout):
    r = generate(server, {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "n": 2},
                          "return_logprob": True, "top_logprobs_num": 2})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    for out in outs:
        meta = out["meta_info"]
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out["output_ids"] and all(lp <= 0 for lp, _, _ in lps)
        tops = meta["output_top_logprobs"]
        assert len(tops) == len(out["output_ids"]) and all(len(top) == 2 for top in tops)
        assert all(top[0][1] == t for top, t in zip(tops, out["output_ids"]))  # greedy: the sampled one leads
        assert "routed_experts" in meta  # the server's default (started with the flag)
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    free = generate(server, {"input_ids": PROMPT, "sampling_params": greedy}).json()["output_ids"]
    stop_at = next(t for t in free[1:] if t != free[0])  # a token that first shows up later
    stopped = generate(server, {"input_ids": PROMPT, "return_routed_experts": False,
                                "sampling_params": {**greedy, "stop_token_ids": [stop_at]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert stopped["output_ids"] == free[: free.index(stop_at) + 1]
    assert "routed_experts" not in stopped["meta_info"]


@pytest.mark.parametrize("body, field", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 2.5}}, "repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"99999": 1}}}, "logit_bias"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ({"input_ids": PROMPT, "routed_experts_start_len": 99}, "routed_experts_start_len"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "top_p"),
])
def test_what_is_not_served_is_a_400_naming_it(server, body, field):
    r = generate(server, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_abort_request_ends_one_or_all_in_flight(server, gate):
    """SGLang's /abort_request, as rollouts stop over-sampled requests: by rid, or abort_all;
    each ends with finish_reason abort and what it generated so far."""
    import concurrent.futures

    long = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
    with gate.allowing(0), concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = {rid: pool.submit(generate, server, {"input_ids": PROMPT, "rid": rid, "sampling_params": long})
                for rid in ("a", "b", "c")}
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/metrics").text.count("r3srv_num_requests_waiting 3.0") == 0:
            assert time.monotonic() < deadline, "the three requests never reached the engine"
            time.sleep(0.01)
        gate.allow(2)  # prefilled together, one decode step, then held in flight short of their 3000 tokens
        while httpx.get(server.url + "/metrics").text.count("r3srv_num_requests_running 3.0") == 0:
            assert time.monotonic() < deadline, "the three requests never ran together"
            time.sleep(0.01)
        assert httpx.post(server.url + "/abort_request", json={"rid": "a"}).status_code == 200
        first = runs["a"].result(timeout=60).json()
        assert not runs["b"].done() and not runs["c"].done()
        assert httpx.post(server.url + "/abort_request", json={"abort_all": True}).status_code == 200
        rest = [runs[rid].result(timeout=60).json() for rid in "bc"]
    for out in [first, *rest]:
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 3000
    assert httpx.post(server.url + "/abort_request", json={}).status_code == 400
