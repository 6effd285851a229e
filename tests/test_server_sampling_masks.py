"""Sampling masks on a real server (`--return-sampling-mask`, SGLang's and vLLM's fields), read
the way their clients read them: SGLang's `output_token_sampling_mask` (ids by descending
probability) with `output_token_sampling_logprobs` in "selected" and "support" modes; slime's
`custom_params.return_top_p_token_ids` as base64 int32 `top_p_token_ids` / `top_p_token_offsets`
(decoded as slime's decode_int32_meta_array does); vLLM's `choices[].sampling_mask` on
/inference/v1/generate, plain and streamed. The same seeded request gives the same masks in
every form; SGLang's top_k bound and the --sampling-mask-max-tokens cap are 400s naming the
field. (Through a --data-parallel-size fleet's one URL: tests/test_fleet_signals.py.)"""

from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import pytest
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow  # real servers

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
CAP = 40
# the built-in model's random weights are peaked: a high temperature gives supports of ~25 ids
SAMPLING = {"max_new_tokens": 8, "temperature": 2.0, "top_k": 30, "top_p": 0.95, "ignore_eos": True,
            "sampling_seed": 7}
MASK_ARGS = ("--return-sampling-mask", "--sampling-mask-max-tokens", str(CAP))


@pytest.fixture(scope="module")
def server():
    with RemoteServer(*MASK_ARGS, *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def sglang(url: str, **fields) -> dict:
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLING, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def slime_int32(meta: dict, key: str) -> np.ndarray:
    """slime's decode_int32_meta_array for a str value: base64, then int32 from the bytes."""
    return np.frombuffer(base64.b64decode(meta[key].encode("ascii")), dtype=np.int32)


def tito_masks(url: str, stream: bool = False) -> list[list[int]]:
    body = {"token_ids": PROMPT, "stream": stream, "sampling_params": {
        "max_tokens": 8, "temperature": 2.0, "top_k": 30, "top_p": 0.95, "ignore_eos": True, "seed": 7}}
    if not stream:
        r = post(url, "/inference/v1/generate", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["sampling_mask"]
    masks: list[list[int]] = []
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    assert len(choice["sampling_mask"] or []) == len(choice["token_ids"])
                    masks += choice["sampling_mask"] or []
    return masks


def test_sglang_masks_in_both_modes(server):
    selected = sglang(server.url, return_sampling_mask=True, return_logprob=True)
    support = sglang(server.url, return_sampling_mask=True, sampling_logprobs_mode="support")
    assert selected["output_ids"] == support["output_ids"]  # seeded: the same draws
    ids, meta = selected["output_ids"], selected["meta_info"]
    masks, chosen = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(chosen) == len(ids) == 8
    assert support["meta_info"]["output_token_sampling_mask"] == masks
    assert min(len(m) for m in masks) > 1  # supports wide enough for the order to show
    for tok, mask, lp, lps in zip(ids, masks, chosen, support["meta_info"]["output_token_sampling_logprobs"]):
        assert tok in mask and 1 <= len(mask) <= 30 and len(set(mask)) == len(mask)
        assert len(lps) == len(mask) and lps == sorted(lps, reverse=True)  # by descending probability
        assert math.isclose(sum(math.exp(v) for v in lps), 1.0, abs_tol=1e-5)
        assert lp == lps[mask.index(tok)]


def test_slime_top_p_token_ids_are_the_same_supports(server):
    masks = sglang(server.url, return_sampling_mask=True)["meta_info"]["output_token_sampling_mask"]
    slime = sglang(server.url, sampling_params={**SAMPLING, "custom_params": {"return_top_p_token_ids": True}})
    meta = slime["meta_info"]
    assert "output_token_sampling_mask" not in meta  # slime's keys only
    ids, offsets = slime_int32(meta, "top_p_token_ids"), slime_int32(meta, "top_p_token_offsets")
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == len(slime["output_ids"]) + 1
    rows = [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert rows == [sorted(m) for m in masks]


def test_vllm_sampling_mask_plain_and_streamed(server):
    masks = sglang(server.url, return_sampling_mask=True)["meta_info"]["output_token_sampling_mask"]
    assert tito_masks(server.url) == [sorted(m) for m in masks]  # ascending, as vLLM's
    assert tito_masks(server.url, stream=True) == [sorted(m) for m in masks]


def test_greedy_masks_are_singletons(server):
    out = sglang(server.url, sampling_params={"max_new_tokens": 4, "temperature": 0.0}, return_sampling_mask=True,
                 sampling_logprobs_mode="support")
    meta = out["meta_info"]
    assert meta["output_token_sampling_mask"] == [[t] for t in out["output_ids"]]
    assert meta["output_token_sampling_logprobs"] == [[0.0]] * len(out["output_ids"])


@pytest.mark.parametrize("body, param", [
    ({"return_sampling_mask": True, "sampling_params": {"top_k": -1}}, "top_k"),
    ({"return_sampling_mask": True, "sampling_params": {"top_k": CAP + 1}}, "top_k"),
    ({"sampling_logprobs_mode": "support"}, "sampling_logprobs_mode"),
    ({"sampling_params": {"top_k": -1, "custom_params": {"return_top_p_token_ids": True}}},
     "sampling_mask_max_tokens"),
])
def test_refusals_are_400s_naming_the_field(server, body, param):
    r = post(server.url, "/generate", {"input_ids": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert post(server.url, "/generate", {"input_ids": PROMPT}).status_code == 200  # the server goes on

