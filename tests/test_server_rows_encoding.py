"""Every routed-experts encoding on a real server, decoded by its framework's own parsing code:
prime-rl's dict by `renderers` (the PyPI package that prime-rl's clients call) and verifiers'
decode, SkyRL's dict, SGLang's int32 in /generate's meta_info and in `sglext` on the OpenAI
routes; each equal to the same request's rows in vLLM's npy, read by numpy's own np.load.

The server runs with `--routed-experts-encoding prime-rl`, so its default and the per-request
override are both exercised. Where a framework's parser is not importable here (verifiers pins
openai<3, SkyRL 0.4 needs Python 3.12, SGLang needs a GPU build), the parse is re-stated from its
source, with the file and version cited."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math

import httpx
import numpy as np
import pybase64
import pytest
from renderers.client import parse_generate_response
from server_fixture import TEST_SERVER_ARGS, RemoteServer

# a real server; the frameworks' own parsing code
pytestmark = [pytest.mark.slow, pytest.mark.peer]

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
START = 5
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server():
    with RemoteServer("--enable-return-routed-experts", "--routed-experts-encoding", "prime-rl",
                      *TEST_SERVER_ARGS) as srv:
        yield srv
    assert srv.returncode == 0, srv.log


def post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def tito(server, encoding: str | None = None, stream: bool = False) -> httpx.Response:
    body = {"token_ids": PROMPT, "stream": stream, "sampling_params": {
        "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "routed_experts_prompt_start": START}}
    if encoding is not None:
        body["routed_experts_encoding"] = encoding
    return post(server, "/inference/v1/generate", body)


def npy_rows(text: str) -> np.ndarray:
    """vLLM's encoding, read by numpy itself (np.load of the base64-decoded .npy)."""
    return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)


@pytest.fixture(scope="module")
def oracle(server):
    """The rows in vLLM's npy (asked per request), and the tokens they go with."""
    choice = tito(server, "npy").json()["choices"][0]
    rows = npy_rows(choice["routed_experts"])
    assert rows.shape[0] == len(PROMPT) + MAX_TOKENS - 1 - START
    return rows, choice["token_ids"]


# verifiers 0.4.0 (PyPI), verifiers/v1/graph.py, `_attribute_routed_experts`: how a prime-rl
# rollout client turns the payload (as `renderers.client.parse_generate_response` hands it over,
# `data` a memoryview of the body) into rows and the token offset of row 0.
def verifiers_rows(payload: dict) -> tuple[np.ndarray, int]:
    raw = binascii.a2b_base64(payload["data"])
    arr = np.frombuffer(raw, dtype=np.dtype(payload.get("dtype", "uint8"))).reshape(payload["shape"])
    return arr, int(payload.get("start", 0) or 0)


def test_prime_rl_dict_is_the_server_default_and_renderers_and_verifiers_read_it(server, oracle):
    rows, token_ids = oracle
    r = tito(server)  # no routed_experts_encoding: the server's --routed-experts-encoding
    parsed = parse_generate_response(r.content)
    choice = parsed["choices"][0]
    assert choice["token_ids"] == token_ids
    payload = choice["routed_experts"]
    assert isinstance(payload["data"], memoryview)  # renderers found it at its exact byte prefix
    assert list(json.loads(r.content)["choices"][0]["routed_experts"]) == ["data", "shape", "start", "dtype"]
    got, start = verifiers_rows(payload)
    assert start == START and payload["dtype"] == "uint8"  # 64 experts: prime-rl's uint8
    np.testing.assert_array_equal(got, rows)


# SkyRL 0.4.0 (PyPI; GitHub NovaSky-AI/SkyRL at a9564572), skyrl/backends/skyrl_train/
# inference_servers/generate_wire.py (`load_packed_body`, `unpack_ndarray`,
# `decode_packed_routed_experts`) and skyrl/backends/skyrl_train/utils/routed_experts.py
# (`compact_routed_expert_indices`): the client splices `data` out of the raw body at
# `"routed_experts":{"data":"`, then accepts only uint8/int16/int32, three non-negative dims,
# exactly prod(shape) * itemsize bytes of strict base64, and the canonical dtype of the largest id.
_SKYRL_DTYPES = {d.name: d for d in (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))}


def skyrl_load_body(raw: bytes) -> dict:
    prefix = b'"routed_experts":{"data":"'
    at = raw.find(prefix)
    if at < 0:
        return json.loads(raw)
    begin = at + len(prefix)
    end = raw.find(b'"', begin)
    body = json.loads(raw[:begin] + raw[end:])
    body["choices"][0]["routed_experts"]["data"] = memoryview(raw)[begin:end]
    return body


def skyrl_decode(payload: dict) -> np.ndarray:
    dtype = _SKYRL_DTYPES[payload["dtype"]]
    shape = tuple(payload["shape"])
    data = pybase64.b64decode_as_bytearray(payload["data"], validate=True)
    if len(shape) != 3 or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise ValueError(f"invalid packed routed_experts shape: {shape}")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError("packed routed_experts has the wrong number of bytes")
    decoded = np.frombuffer(data, dtype=dtype).reshape(shape)
    largest = int(decoded.max(initial=0))
    canonical = np.uint8 if largest < 2**8 else np.int16 if largest < 2**15 else np.int32
    if int(decoded.min(initial=0)) < 0 or decoded.dtype != canonical:
        raise ValueError("packed routed_experts uses a non-canonical dtype")
    return decoded


def test_skyrl_dict_as_skyrls_client_reads_it(server, oracle):
    rows, token_ids = oracle
    r = tito(server, "skyrl")
    body = skyrl_load_body(r.content)
    choice = body["choices"][0]
    assert choice["token_ids"] == token_ids
    assert isinstance(choice["routed_experts"]["data"], memoryview)
    assert sorted(choice["routed_experts"]) == ["data", "dtype", "shape"]  # no start in SkyRL's
    np.testing.assert_array_equal(skyrl_decode(choice["routed_experts"]), rows)


# SGLang 0.5.23, sglang/srt/state_capturer/routed_experts.py, `extract_routed_experts_from_meta_info`:
# np.frombuffer(pybase64.b64decode(text.encode("utf-8")), dtype=np.int32), which clients reshape
# to (-1, num_layers, top_k).
def sglang_rows(text: str, like: np.ndarray) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(text.encode("utf-8")), dtype=np.int32).reshape(-1, *like.shape[1:])


def test_sglang_int32_in_generate_meta_info(server, oracle):
    rows, token_ids = oracle
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.0,
                                                     "ignore_eos": True},
            "routed_experts_start_len": START}
    default = post(server, "/generate", body).json()["meta_info"]["routed_experts"]
    assert default["start"] == START  # the server's flag reaches SGLang's route too
    np.testing.assert_array_equal(verifiers_rows(default)[0], rows)
    out = post(server, "/generate", {**body, "routed_experts_encoding": "sglang"}).json()
    assert out["output_ids"] == token_ids
    np.testing.assert_array_equal(sglang_rows(out["meta_info"]["routed_experts"], rows), rows)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sglang_int32_in_sglext_on_the_openai_routes(server, path):
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = {**prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "routed_experts_prompt_start": 2}
    want = npy_rows(post(server, path, {**body, "routed_experts_encoding": "npy"}).json()["choices"][0]["routed_experts"])
    out = post(server, path, {**body, "routed_experts_encoding": "sglang"}).json()
    assert out["choices"][0]["routed_experts"] is None  # SGLang's place is the response's sglext
    np.testing.assert_array_equal(sglang_rows(out["sglext"]["routed_experts"], want), want)
    # Streaming: a chunk of its own with no choices (as SGLang's), after the choices' chunks.
    text = post(server, path, {**body, "routed_experts_encoding": "sglang", "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    with_sglext = [c for c in chunks if "sglext" in c]
    assert len(with_sglext) == 1 and with_sglext[0]["choices"] == [] and chunks[-1] is with_sglext[0]
    np.testing.assert_array_equal(sglang_rows(with_sglext[0]["sglext"]["routed_experts"], want), want)
    # The server default (prime-rl) on the same route: the dict in the choice, no sglext.
    default = post(server, path, body).json()
    assert "sglext" not in default
    np.testing.assert_array_equal(verifiers_rows(default["choices"][0]["routed_experts"])[0], want)


def test_streamed_tito_carries_the_dict_in_its_final_chunk(server, oracle):
    rows, _ = oracle
    text = tito(server, stream=True).text
    finals = [c for c in (json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {"))
              if c["choices"] and c["choices"][0].get("routed_experts")]
    assert len(finals) == 1
    np.testing.assert_array_equal(verifiers_rows(finals[0]["choices"][0]["routed_experts"])[0], rows)


@pytest.mark.parametrize("path, body", [
    ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("/generate", {"input_ids": PROMPT}),
])
def test_unknown_encoding_is_a_400_naming_the_field(server, path, body):
    r = httpx.post(server.url + path, json={**body, "routed_experts_encoding": "json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "routed_experts_encoding"
