"""`r3srv serve --logprobs-mode processed_logprobs` on every route, read as each dialect's client
reads it: vLLM's completions and chat (the openai SDK), vLLM's /inference/v1/generate and
SGLang's /generate (httpx). The same seeded request gives the offline engine's processed
logprobs (which tests/test_logprobs_mode.py holds against a float64 oracle), SGLang's sampling
mask's selected logprob, top entries that are a distribution over the top-k support, and the
tokens top-k dropped at vLLM's floor (-9999.0; null in SGLang's meta_info, as SGLang's own JSON)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

from r3srv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a real server

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
TOP_K, TOP = 4, 6  # top entries asked for beyond the support: at least two dropped tokens per step
SEEDED = {"temperature": 2.0, "top_k": TOP_K, "ignore_eos": True}
STEPS = 6
FLOOR = -9999.0


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def offline():
    """The offline engine in the same mode: the seeded request's tokens and logprobs."""
    llm = LLM(max_model_len=256, num_kv_blocks=64, logprobs_mode="processed_logprobs")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=STEPS, seed=7, logprobs=TOP, **SEEDED))[0].outputs[0]
    llm.shutdown()
    return out.token_ids, [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)]


def openai_sdk(server) -> tuple[openai.OpenAI, str]:
    """The openai SDK on the server's /v1, and the served model's name."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_processed_top(values: list[float | None], dropped: float | None) -> None:
    """A step's top entries: the support's TOP_K sum to 1 in probability, the others dropped
    (completions key them by text, where two dropped bytes may read alike)."""
    kept = [v for v in values if v != dropped]
    assert len(kept) == TOP_K and len(values) > TOP_K
    assert math.isclose(sum(math.exp(v) for v in kept), 1.0, abs_tol=1e-5)


def test_vllm_completions(server, offline):
    tokens, logprobs = offline
    client, model = openai_sdk(server)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=STEPS, seed=7, logprobs=TOP,
                                  temperature=2.0, extra_body={"top_k": TOP_K, "ignore_eos": True,
                                                               "return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == tokens
    assert c.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    for top in c.logprobs.top_logprobs:
        assert_processed_top(list(top.values()), FLOOR)


def test_vllm_chat(server):
    client, model = openai_sdk(server)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=STEPS,
                                       seed=3, temperature=2.0, logprobs=True, top_logprobs=TOP,
                                       extra_body={"top_k": TOP_K, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == STEPS
    for step in content:
        assert step.logprob > FLOOR
        assert_processed_top([t.logprob for t in step.top_logprobs], FLOOR)


def test_vllm_tito_generate(server, offline):
    tokens, logprobs = offline
    choice = post(server.url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": STEPS, "seed": 7, "logprobs": TOP, **SEEDED}})["choices"][0]
    assert choice["token_ids"] == tokens
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(logprobs, abs=1e-5)
    for c in content:
        assert_processed_top([t["logprob"] for t in c["top_logprobs"]], FLOOR)


def test_sglang_generate_equals_the_sampling_masks_selected_logprob(server, offline):
    tokens, logprobs = offline
    out = post(server.url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": TOP,
                                         "return_sampling_mask": True, "sampling_params": {
                                             "max_new_tokens": STEPS, "sampling_seed": 7, **SEEDED}})
    meta = out["meta_info"]
    assert out["output_ids"] == tokens
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert got == pytest.approx(logprobs, abs=1e-5)
    # the mask's selected logprob is the draw's log-probability, read another way (log of the probs)
    assert got == pytest.approx(meta["output_token_sampling_logprobs"], abs=1e-5)
    for top in meta["output_top_logprobs"]:
        assert_processed_top([lp for lp, _, _ in top], None)
