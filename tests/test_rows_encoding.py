"""The routed-experts selector (server/rows_encoding.py): which encoding a response gets, and
that each is the pure-Python reference's text (r3srv.serial), with each framework's dtype rule."""

from __future__ import annotations

import asyncio
import json

import msgspec
import numpy as np
import pytest
from litestar.serialization import encode_json

from r3srv.serial import decode_packed, numpy2base64, packed2json, raw2base64
from r3srv.server import protocol as p
from r3srv.server import rows_encoding as re
from r3srv.server.generation import ServerState
from r3srv.server.metrics import ServerMetrics


@pytest.mark.parametrize(
    "requested, server, route, want",
    [
        (None, "auto", "npy", "npy"),
        (None, "auto", "sglang", "sglang"),
        (None, "prime-rl", "npy", "prime-rl"),
        (None, "prime-rl", "sglang", "prime-rl"),
        ("npy", "prime-rl", "sglang", "npy"),
        ("skyrl", "auto", "npy", "skyrl"),
    ],
)
def test_request_then_server_then_route(requested, server, route, want):
    assert re.choose(requested, server, route) == want


def _rows(experts: int, rows: int = 7) -> np.ndarray:
    dtype = np.uint8 if experts <= 256 else np.uint16 if experts <= 65536 else np.int32  # the engine's rule
    return np.random.default_rng(experts).integers(0, experts, (rows, 3, 2)).astype(dtype)


@pytest.mark.parametrize("experts", [64, 256, 257, 512, 40_000, 70_000])
def test_each_encoding_is_its_reference(experts):
    rows = _rows(experts)
    assert re.encode(rows, "npy", 3) == f'"{numpy2base64(rows)}"'
    assert re.encode(rows, "sglang", 3) == f'"{raw2base64(rows, "int32")}"'
    assert re.encode(rows, "prime-rl", 3) == packed2json(rows, re.PRIME_RL_DTYPES, 3)
    assert re.encode(rows, "skyrl", 3) == packed2json(rows, re.SKYRL_DTYPES)
    with pytest.raises(ValueError, match="unknown routed experts encoding"):
        re.encode(rows, "json", 0)


@pytest.mark.parametrize(
    "largest, prime_rl, skyrl",
    [(255, "uint8", "uint8"), (256, "uint16", "int16"), (32_767, "uint16", "int16"), (32_768, "uint16", "int32"),
     (65_535, "uint16", "int32"), (65_536, "int32", "int32")],
)
def test_dtype_follows_the_largest_id_as_each_framework_does(largest, prime_rl, skyrl):
    # prime-rl's server: uint8 unless an id exceeds 255, then uint16 (it stops there; past it
    # r3srv sends int32). SkyRL's: uint8 below 2**8, int16 below 2**15, int32 below 2**31; its
    # client refuses any other dtype for the same ids.
    rows = np.zeros((2, 3, 2), np.int32)
    rows[1, 2, 1] = largest
    assert json.loads(re.encode(rows, "prime-rl", 0))["dtype"] == prime_rl
    packed = re.encode(rows, "skyrl", 0)
    assert json.loads(packed)["dtype"] == skyrl
    np.testing.assert_array_equal(decode_packed(packed).array, rows)


def test_payload_bytes_counts_the_base64_of_strings_and_whole_dicts():
    assert re.payload_bytes('"QUJD"') == 4
    assert re.payload_bytes('{"data":"QUJD"}') == 15


@pytest.mark.parametrize("rows", [3, 4000])  # 4000 rows (1.5 MB) are encoded on a worker thread
def test_responses_embed_each_encoding_as_written(rows):
    """ServerState.encode_experts hands the Rust core's JSON text to msgspec as Raw: the response
    (msgspec's and Litestar's encoders) carries it verbatim, a string or an object, and the
    routed-experts byte counter counts the value."""
    state = ServerState(engine=None, model_name="m", metrics=ServerMetrics(lambda: None))
    array = np.random.default_rng(rows).integers(0, 64, (rows, 48, 8), dtype=np.uint8)
    counted = 0
    for encoding, want in [("prime-rl", packed2json(array, re.PRIME_RL_DTYPES, 5)),
                           ("skyrl", packed2json(array, re.SKYRL_DTYPES)),
                           ("sglang", json.dumps(raw2base64(array, "int32")))]:
        embedded = asyncio.run(state.encode_experts(array, encoding, 5))
        assert isinstance(embedded, msgspec.Raw) and bytes(embedded) == want.encode()
        choice = p.GenerateChoice(index=0, token_ids=[1], routed_experts=embedded)
        for body in (msgspec.json.encode(choice), encode_json(choice)):
            assert json.loads(body)["routed_experts"] == json.loads(want)
        counted += re.payload_bytes(want)
        assert state.metrics.routed_experts_bytes._value.get() == counted
    sglext = re.SglExt(routed_experts=asyncio.run(state.encode_experts(array, "sglang")))
    body = encode_json(p.CompletionResponse(id="c", model="m", choices=[], usage=p.UsageInfo(), sglext=sglext))
    assert json.loads(body)["sglext"] == {"routed_experts": raw2base64(array, "int32")}
    assert "sglext" not in json.loads(encode_json(p.CompletionResponse(id="c", model="m", choices=[], usage=p.UsageInfo())))
