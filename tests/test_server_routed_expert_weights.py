"""Router weights on a real server (`--enable-return-routed-expert-weights`): SGLang's
`meta_info.routed_expert_weights` on /generate and r3srv's `choices[].routed_expert_weights` on
vLLM's /inference/v1/generate, decoded with `r3srv.serial.decode_expert_weights` and checked
against transformers' router on the same tiny Qwen3-MoE; bfloat16 is the float32 answer
rounded; without the flag the ask is a 400 naming the field."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
from server_fixture import TEST_SERVER_ARGS, RemoteServer
from tiny_checkpoints import build_hf_model, hf_router_weights, write_tiny_checkpoint

from r3srv import serial

pytestmark = pytest.mark.slow  # real servers, a transformers oracle

pytest.importorskip("transformers")

PROMPT = list(b"Router weights over the wire")
SEED = 3
RTOL, ATOL = 1e-5, 1e-6  # the oracle runs the sequence in one pass, the server prefill + decode


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3_moe", "qwen3_moe", seed=SEED)


def test_weights_on_both_routes_match_transformers(checkpoint):
    hf = build_hf_model("qwen3_moe", seed=SEED)
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with RemoteServer(str(checkpoint), "--enable-return-routed-experts", "--enable-return-routed-expert-weights",
                      # no prefix hits: the four sends compute alike, so their weights compare bitwise
                      "--dtype", "float32", "--no-enable-prefix-caching", *TEST_SERVER_ARGS) as srv:
        r = post(srv.url, "/generate", {"input_ids": PROMPT, "sampling_params": sampling,
                                        "return_routed_expert_weights": True})
        assert r.status_code == 200, r.text
        out = r.json()
        bf16 = post(srv.url, "/generate", {"input_ids": PROMPT, "sampling_params": sampling,
                                           "return_routed_expert_weights": True,
                                           "routed_expert_weights_dtype": "bfloat16"}).json()
        plain = post(srv.url, "/generate", {"input_ids": PROMPT, "sampling_params": sampling}).json()
        tito = post(srv.url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_routed_expert_weights": True}})
        assert tito.status_code == 200, tito.text
        streamed = _streamed_weights(srv.url)
    assert srv.returncode == 0, srv.log
    meta = out["meta_info"]
    full = PROMPT + out["output_ids"]
    ids, expected = hf_router_weights(hf, full[:-1], 2, 2)
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(ids.shape)
    np.testing.assert_array_equal(rows, ids)  # the weights' order is the rows'
    weights = serial.decode_expert_weights(meta["routed_expert_weights"])
    assert meta["routed_expert_weights"]["dtype"] == "float32" and weights.shape == ids.shape
    np.testing.assert_allclose(weights, expected, rtol=RTOL, atol=ATOL)
    rounded = torch.from_numpy(weights).to(torch.bfloat16).float().numpy()
    assert bf16["meta_info"]["routed_expert_weights"]["dtype"] == "bfloat16"
    np.testing.assert_array_equal(serial.decode_expert_weights(bf16["meta_info"]["routed_expert_weights"]), rounded)
    assert "routed_expert_weights" not in plain["meta_info"]  # only when asked
    choice = tito.json()["choices"][0]
    assert choice["token_ids"] == out["output_ids"]
    np.testing.assert_array_equal(serial.decode_expert_weights(choice["routed_expert_weights"]), weights)
    np.testing.assert_array_equal(serial.decode_expert_weights(streamed), weights)


def _streamed_weights(url: str) -> dict:
    """The one routed_expert_weights of a streamed /inference/v1/generate (on the last chunk)."""
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {
        "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_routed_expert_weights": True}}
    found = []
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                if "routed_expert_weights" in choice:
                    found.append((choice["finish_reason"], choice["routed_expert_weights"]))
    assert len(found) == 1 and found[0][0] == "length"
    return found[0][1]


def test_weights_without_the_flag_are_a_400():
    with RemoteServer("--enable-return-routed-experts", *TEST_SERVER_ARGS) as srv:
        sglang = post(srv.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                             "return_routed_expert_weights": True})
        tito = post(srv.url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 2, "return_routed_expert_weights": True}})
    for r in (sglang, tito):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "return_routed_expert_weights"
