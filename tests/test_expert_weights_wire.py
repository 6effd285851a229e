"""r3srv.serial's router-weights form: float32 round-trips bitwise, bfloat16 is torch's rounding
of the float32, and the decoder refuses anything else with a ValueError."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest
import torch

from r3srv import serial


def weights(seed: int = 0, shape=(5, 3, 4)) -> np.ndarray:
    w = np.random.default_rng(seed).random(shape, dtype=np.float32)
    w[0, 0, 0] = np.float32(1.0) + np.float32(2.0 ** -8)  # a bfloat16 tie: rounds to even (1.0)
    return w


def test_float32_round_trip_and_form():
    w = weights()
    packed = serial.encode_expert_weights(w, "float32")
    assert packed["dtype"] == "float32" and packed["shape"] == [5, 3, 4]
    assert base64.b64decode(packed["data"]) == w.astype("<f4").tobytes()
    np.testing.assert_array_equal(serial.decode_expert_weights(packed), w)
    np.testing.assert_array_equal(serial.decode_expert_weights(msgspec.json.encode(packed)), w)


def test_bfloat16_is_torch_rounding():
    w = weights(1)
    decoded = serial.decode_expert_weights(serial.encode_expert_weights(w, "bfloat16"))
    np.testing.assert_array_equal(decoded, torch.from_numpy(w).to(torch.bfloat16).float().numpy())
    assert decoded[0, 0, 0] == 1.0


@pytest.mark.parametrize("payload", [
    {"data": "AAAAAA==", "shape": [2], "dtype": "float32"},              # 1 value, shape wants 2
    {"data": "AAAAAA==", "shape": [1], "dtype": "float16"},              # not a weights dtype
    {"data": "AAAAAA", "shape": [1], "dtype": "float32"},                # unpadded base64
    {"data": "AAAAAA==", "shape": [1], "dtype": "float32", "start": 0},  # an unknown key
    {"data": "AAAAAA==", "shape": [-1], "dtype": "float32"},
    {"data": "AAAAAA==", "dtype": "float32"},
    "[1, 2]",
])
def test_decoder_refuses_hostile_payloads(payload):
    with pytest.raises(ValueError):
        serial.decode_expert_weights(payload)


def test_encoder_refuses_unknown_dtype():
    with pytest.raises(ValueError, match="float16"):
        serial.encode_expert_weights(weights(), "float16")
