"""Indexer top-k on a real server (`--enable-return-indexer-topk`) serving a tiny GLM-MoE-DSA
(layers full, shared, full; index_topk 5): SGLang's `meta_info.indexer_topk` on /generate (raw
int32, every layer, the shared one repeating the layer before) and vLLM's `choices[].indexer_topk`
(base64 .npy int32, the indexer layers) on /v1/completions, /v1/chat/completions and
/inference/v1/generate, against transformers' indexer modules; the cap is a 400 naming its flag."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from test_indexer_topk import hf_selections
from tiny_checkpoints import build_hf_model, write_tiny_checkpoint

from r3srv import serial

pytestmark = pytest.mark.slow  # a real server, a transformers oracle

pytest.importorskip("transformers")

KWARGS = {"num_layers": 3, "indexer_types": ["full", "shared", "full"], "first_k_dense_replace": 1}
SEED = 4
PROMPT = list(b"Sparse attention, replayed")
CAP = 400  # values: 40 tokens x 2 indexer layers x 5


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def as_sets(topk: np.ndarray) -> list[list[list[int]]]:
    return [[sorted(int(v) for v in layer if v >= 0) for layer in row] for row in topk]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "glm5", "glm_moe_dsa", seed=SEED, **KWARGS)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with RemoteServer(str(path), "--enable-return-indexer-topk", "--indexer-topk-max-values", str(CAP),
                      "--dtype", "float32", *TEST_SERVER_ARGS) as srv:
        got = {
            "sglang": post(srv.url, "/generate", {"input_ids": PROMPT, "return_indexer_topk": True,
                                                  "sampling_params": {"max_new_tokens": 6, **greedy}}),
            "sglang_plain": post(srv.url, "/generate", {"input_ids": PROMPT,
                                                        "sampling_params": {"max_new_tokens": 6, **greedy}}),
            "completions": post(srv.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **greedy,
                                                             "return_token_ids": True, "indexer_topk_prompt_start": 2}),
            "chat": post(srv.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "sparse?"}], "max_tokens": 4, **greedy,
                "return_token_ids": True}),
            "tito": post(srv.url, "/inference/v1/generate", {"token_ids": PROMPT,
                                                             "sampling_params": {"max_tokens": 6, **greedy}}),
            "tito_stream": httpx.post(srv.url + "/inference/v1/generate", timeout=120, json={
                "token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 6, **greedy}}),
            "over_cap": post(srv.url, "/generate", {"input_ids": PROMPT, "return_indexer_topk": True,
                                                    "sampling_params": {"max_new_tokens": 20, **greedy}}),
        }
    assert srv.returncode == 0, srv.log
    return got, build_hf_model("glm_moe_dsa", seed=SEED, **KWARGS)


def test_sglang_generate(answers):
    got, hf = answers
    r = got["sglang"]
    assert r.status_code == 200, r.text
    out = r.json()
    full = PROMPT + out["output_ids"]
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["indexer_topk"]), dtype="<i4")
    topk = raw.reshape(-1, 3, 5)  # SGLang's (seqlen - 1, num_hidden_layers, index_topk)
    np.testing.assert_array_equal(serial.decode_raw(out["meta_info"]["indexer_topk"], "int32", (3, 5)), topk)
    assert topk.shape[0] == len(full) - 1
    np.testing.assert_array_equal(topk[:, 1], topk[:, 0])  # the shared layer attends with layer 0's
    want = hf_selections(hf, full[:-1])
    assert as_sets(topk[:, [0, 2]]) == want
    assert "indexer_topk" not in got["sglang_plain"].json()["meta_info"]  # SGLang's: only when asked
    over = got["over_cap"]
    assert over.status_code == 400 and over.json()["error"]["param"] == "indexer_topk_max_values", over.text


def _npy(text: str) -> np.ndarray:
    array = np.load(io.BytesIO(base64.b64decode(text)))
    np.testing.assert_array_equal(serial.decode_routed_experts(text), array)  # r3srv's strict decoder agrees
    return array


def test_vllm_routes(answers):
    got, hf = answers
    for name in ("completions", "chat", "tito"):
        assert got[name].status_code == 200, got[name].text
    c = got["completions"].json()["choices"][0]
    full = c["prompt_token_ids"] + c["token_ids"]
    topk = _npy(c["indexer_topk"])  # vLLM's (num_tokens - 1 - start, indexer layers, index_topk)
    assert topk.dtype == np.int32 and topk.shape == (len(full) - 1 - 2, 2, 5)
    assert as_sets(topk) == hf_selections(hf, full[:-1])[2:]
    g = got["tito"].json()["choices"][0]
    full = PROMPT + g["token_ids"]
    assert as_sets(_npy(g["indexer_topk"])) == hf_selections(hf, full[:-1])
    chunks = [json.loads(line[len("data: "):]) for line in got["tito_stream"].text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    carried = [ch["indexer_topk"] for chunk in chunks for ch in chunk["choices"] if "indexer_topk" in ch]
    assert carried == [g["indexer_topk"]]  # once, on the choice's last chunk: the plain answer's
    chat = got["chat"].json()["choices"][0]
    full = got["chat"].json()["prompt_token_ids"] + chat["token_ids"]
    assert as_sets(_npy(chat["indexer_topk"])) == hf_selections(hf, full[:-1])
