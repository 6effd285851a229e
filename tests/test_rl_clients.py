"""The rollout requests RL frameworks send in their default configurations, against a real
`r3srv serve --enable-return-routed-experts --enable-weight-updates`, read back the way each
framework's client reads the answer.

The frameworks' clients are not imported (they need GPUs or pull whole training stacks): each
request is recorded from the client code at a pinned commit, cited as FILE:LINE, and each answer
is read with the rule that client applies (how it decodes the routed experts, which meta_info
keys it needs). Pinned commits (docs/rl.md names them with the frameworks' flags):

- slime  THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
- miles  radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76
- AReaL  areal-project/AReaL@cbff54d645d2cd8ee1f1c358a82f3f473588433d
- SkyRL  NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265
- prime-rl PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
"""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import pytest

from r3srv.serial import decode_routed_experts
from server_fixture import TEST_SERVER_ARGS, RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.peer]  # a real server; recorded from the frameworks' clients


MAX_MODEL_LEN = 128
PROMPT = [5, 17, 42, 99, 7, 3]


SERVE = ("--enable-return-routed-experts", "--enable-weight-updates", "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def http():
    """A client of one server for the module (the frameworks' defaults, as docs/rl.md gives them)."""
    with RemoteServer(*SERVE, *TEST_SERVER_ARGS) as srv, httpx.Client(base_url=srv.url, timeout=180) as client:
        yield client
    assert srv.returncode == 0, srv.log


@pytest.fixture(scope="module")
def layout(http):
    info = http.get("/v1/models").json()["data"][0]["routed_experts"]
    return info["num_layers"], info["top_k"]


def post_ok(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:500]}"
    return r.json()


def int32_rows(text: str) -> np.ndarray:
    """SGLang's meta_info.routed_experts as slime, miles and AReaL read it: base64 of int32."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32)


def npy_rows(http, tokens: list[int], start: int, max_tokens: int) -> np.ndarray:
    """The same generation's rows through vLLM's token route (greedy, so the same tokens): the
    npy contract, decoded by r3srv's own decoder, as the independent reading."""
    body = {"token_ids": tokens, "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0,
                                                      "routed_experts_prompt_start": start}}
    return decode_routed_experts(post_ok(http, "/inference/v1/generate", body)["choices"][0]["routed_experts"])


# ---------------------------------------------------------------- slime and miles: SGLang's /generate

def slime_sampling_params(max_new_tokens: int) -> dict:
    """slime/rollout/sglang_rollout.py:94-105 (GenerateState), slime's defaults: rollout_temperature 1.0
    (0.0 here: greedy, to compare), rollout_top_p 1.0 (so no custom_params), rollout_top_k -1,
    rollout_stop / rollout_stop_token_ids None, rollout_skip_special_tokens False. miles sends the same
    (miles/rollout/sglang_rollout.py:86-96)."""
    return dict(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None,
                stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                spaces_between_special_tokens=False)


def test_slime_and_miles_rollout_turns(http, layout):
    """slime/rollout/sglang_rollout.py:176-191 (payload: return_logprob, return_routed_experts with
    --use-rollout-routing-replay, input_ids); read as slime/utils/types.py:352-375 does: int32 rows,
    (len(tokens) - 1 - routed_experts_start_len, num_layers, top_k); tokens from
    output_token_logprobs (sglang_rollout.py:197-200). A second turn sends the whole conversation
    with routed_experts_start_len (miles' multi-turn offset, echoed in meta_info)."""
    num_layers, top_k = layout
    tokens = list(PROMPT)
    start = 0
    for turn in range(2):
        body = {"sampling_params": slime_sampling_params(6), "return_logprob": True, "return_routed_experts": True,
                "input_ids": tokens, "routed_experts_start_len": start}
        out = post_ok(http, "/generate", body)
        meta = out["meta_info"]
        new_tokens = [item[1] for item in meta["output_token_logprobs"]]
        assert all(isinstance(item[0], float) for item in meta["output_token_logprobs"])
        assert new_tokens == out["output_ids"] and len(new_tokens) == meta["completion_tokens"] == 6
        assert isinstance(out["text"], str) and meta["finish_reason"]["type"] in ("length", "stop", "abort")
        assert meta["prompt_tokens"] == len(tokens) and "cached_tokens" in meta and "weight_version" in meta
        assert meta["routed_experts_start_len"] == start
        rows = int32_rows(meta["routed_experts"])
        full = tokens + new_tokens
        expected_rows = len(full) - 1 - start
        assert rows.size == expected_rows * num_layers * top_k
        oracle = npy_rows(http, tokens, start, 6)
        assert np.array_equal(rows.reshape(expected_rows, num_layers, top_k), oracle.astype(np.int32))
        if turn == 0:
            assert meta["cached_tokens"] == 0 or meta["cached_tokens"] <= len(tokens)
        start = len(full) - 1  # the rows this client holds
        tokens = full + [11, 12]  # the environment's reply


def test_slime_top_p_token_ids(http):
    """slime/rollout/sglang_rollout.py:106-107: with rollout_top_p < 1, custom_params asks for the
    top-p token ids; read as slime/utils/misc.py's decode_int32_meta_array and types.py's
    append_response_tokens read them: meta_info's top_p_token_ids and top_p_token_offsets, base64
    of int32, offsets one more than the response tokens, from 0 to the ids' count; every sampled
    token (from output_token_logprobs) is in its row."""
    params = {**slime_sampling_params(4), "temperature": 1.0, "top_p": 0.9, "sampling_seed": 3,
              "custom_params": {"return_top_p_token_ids": True}}
    out = post_ok(http, "/generate", {"sampling_params": params, "input_ids": PROMPT, "return_logprob": True})
    meta = out["meta_info"]
    tokens = [t for _, t, _ in meta["output_token_logprobs"]]
    ids = np.frombuffer(base64.b64decode(meta["top_p_token_ids"].encode("ascii")), dtype=np.int32)
    offsets = np.frombuffer(base64.b64decode(meta["top_p_token_offsets"].encode("ascii")), dtype=np.int32)
    assert len(offsets) == len(tokens) + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    assert np.all(np.diff(offsets) >= 1) and ids.min() >= 0
    for t, tok in enumerate(tokens):
        assert tok in ids[offsets[t]:offsets[t + 1]].tolist()
    params["custom_params"] = {"some_processor_arg": 1}  # without that key: no ids, as SGLang
    assert "top_p_token_ids" not in post_ok(http, "/generate", {"sampling_params": params, "input_ids": PROMPT})[
        "meta_info"]


def test_slime_and_miles_abort_all(http):
    """slime/backends/sglang_utils/server_control.py:34 and miles/rollout/sglang_rollout.py:408:
    POST /abort_request {"abort_all": true} on each worker between rollouts."""
    r = http.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200, r.text


def test_miles_session_chat_with_meta_info(http, layout):
    """miles/rollout/session/core.py:170-186 and :386: the session server posts /v1/chat/completions
    with its own input_ids, logprobs, return_meta_info, return_routed_experts and no_stop_trim false,
    and reads choices[0].meta_info (core.py:218-236): output_token_logprobs as long as
    completion_tokens, message.content not null; merge.py:164-175 reads meta_info.routed_experts for
    len(input_ids) + len(output) - 1 - routed_experts_start_len rows."""
    num_layers, top_k = layout
    for start in (0, 3):
        body = {"messages": [{"role": "user", "content": "hi"}], "input_ids": PROMPT, "max_tokens": 5,
                "temperature": 0.0, "logprobs": True, "return_meta_info": True, "return_routed_experts": True,
                "no_stop_trim": False, "routed_experts_start_len": start}
        choice = post_ok(http, "/v1/chat/completions", body)["choices"][0]
        meta = choice["meta_info"]
        assert choice["message"]["content"] is not None
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 5
        output = [t[1] for t in meta["output_token_logprobs"]]
        assert all(isinstance(t[2], str) for t in meta["output_token_logprobs"])  # the chat route's token texts
        rows = int32_rows(meta["routed_experts"])
        assert rows.size == (len(PROMPT) + len(output) - 1 - start) * num_layers * top_k
        oracle = npy_rows(http, PROMPT, start, 5)
        assert np.array_equal(rows.reshape(oracle.shape), oracle.astype(np.int32))
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_meta_info"  # SGLang's rule


# ---------------------------------------------------------------- AReaL: SGLang's /generate

def test_areal_rollout(http, layout):
    """areal/engine/sglang_remote.py:54-102 with AReaL's GenerationHyperparameters defaults
    (areal/api/cli_args.py: max_new_tokens 16384, top_k 1e8, stop_token_ids [], image_data [] from
    areal/api/io_struct.py:40); read as sglang_remote.py:105-138 does: rows reshaped to
    (prompt_tokens + completion_tokens - 1, -1)."""
    num_layers, top_k = layout
    body = {
        "input_ids": list(PROMPT), "image_data": [],
        "sampling_params": {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": 16384, "temperature": 0.0,
                            "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
                            "frequency_penalty": 0.0},
        "return_logprob": True, "stream": False, "return_routed_experts": True,
    }
    meta = post_ok(http, "/generate", body)["meta_info"]
    assert meta["finish_reason"]["type"] == "length"  # max_new_tokens clipped to the context, as SGLang
    tokens = [x[1] for x in meta["output_token_logprobs"]]
    assert len(tokens) == MAX_MODEL_LEN - len(PROMPT)
    rows = int32_rows(meta["routed_experts"]).reshape(meta["prompt_tokens"] + meta["completion_tokens"] - 1, -1)
    assert rows.shape[1] == num_layers * top_k


# ---------------------------------------------------------------- SkyRL: /skyrl/v1/generate

def skyrl_decode(payload: dict) -> np.ndarray:
    """skyrl/backends/skyrl_train/inference_servers/generate_wire.py:88-111: the dtype must be the
    canonical one for the largest id (uint8, int16, int32: utils/routed_experts.py:9-34)."""
    dtype = np.dtype(payload["dtype"])
    shape = tuple(payload["shape"])
    data = base64.b64decode(payload["data"], validate=True)
    assert len(shape) == 3 and len(data) == math.prod(shape) * dtype.itemsize
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    largest = int(array.max(initial=0))
    canonical = "uint8" if largest < 2**8 else "int16" if largest < 2**15 else "int32"
    assert dtype.name == canonical
    return array


def test_skyrl_rollout(http, layout):
    """skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py:486-530 (the route with
    routed experts on, its payload and how it reads the choice) with the sampling params of
    engine_utils.py:55-68 and a cache_salt of "<model name>@<weight version>" (a name with '/')."""
    body = {
        "sampling_params": {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                            "max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                            "logprobs": 0, "stop": None},
        "model": "r3srv-builtin-random-moe", "token_ids": list(PROMPT), "cache_salt": "org/model@global_step_3",
    }
    choice = post_ok(http, "/skyrl/v1/generate", body)["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == 6 and all(math.isfinite(v) and v <= 0 for v in logprobs)
    rows = skyrl_decode(choice["routed_experts"])
    oracle = npy_rows(http, PROMPT, 0, 6)
    assert np.array_equal(rows.astype(np.int64), oracle.astype(np.int64))
    # SkyRL detokenizes through vLLM's /detokenize, one sequence per request (remote_inference_client.py:880-891)
    assert isinstance(post_ok(http, "/detokenize", {"model": body["model"], "tokens": choice["token_ids"]})["prompt"], str)


# ---------------------------------------------------------------- prime-rl: vLLM's token ids in logprobs

@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logprob_tokens_as_token_ids(http, route):
    """prime-rl's client parses each logprob entry's token as "token_id:<id>" (vLLM's
    return_tokens_as_token_ids, per request or --return-tokens-as-token-ids)."""
    body = {"max_tokens": 4, "temperature": 0.0, "logprobs": True if route.endswith("chat/completions") else 1,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    body.update({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1} if "chat" in route
                else {"prompt": PROMPT})
    choice = post_ok(http, route, body)["choices"][0]
    if "chat" in route:
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    else:
        tokens = choice["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
