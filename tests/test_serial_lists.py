"""Ragged lists (r3srv.serial: sampling masks and their logprobs as JSON): the Rust writers
against the stdlib references byte for byte on generated rows (ids across int32, floats from
raw bits: NaN, infinities, subnormals, negative zero; empty rows, no rows), their refusal of
bad offsets, and the strict decoder on their output and on hostile text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3srv.serial import decode_int_lists, encode_float_lists, encode_int_lists, float_lists2json, int_lists2json

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_lengths = st.lists(st.integers(0, 9), max_size=12)


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@SETTINGS
@given(lengths=_lengths, seed=st.integers(0, 2**32 - 1))
def test_int_lists_equal_the_reference(lengths, seed):
    rng = np.random.default_rng(seed)
    offsets = _offsets(lengths)
    values = rng.integers(-(2**31), 2**31, int(offsets[-1]), dtype=np.int64).astype(np.int32)
    values[:1] = np.iinfo(np.int32).min
    text = encode_int_lists(values, offsets)
    assert text == int_lists2json(values, offsets)
    back, back_offsets = decode_int_lists(text)
    np.testing.assert_array_equal(back, values)
    np.testing.assert_array_equal(back_offsets, offsets)


@SETTINGS
@given(lengths=_lengths, seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(["<f4", "<f8"]),
       flat=st.booleans())
def test_float_lists_equal_the_reference(lengths, seed, dtype, flat):
    """Floats from raw bits: every class of float32/float64 value, written as Python's repr."""
    rng = np.random.default_rng(seed)
    offsets = _offsets(lengths)
    size = int(offsets[-1])
    values = rng.integers(0, 256, size * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    specials = np.array([0.0, -0.0, 1e16, 1e-5, 1e-4, 123456.0, 5e-324, np.inf, -np.inf, np.nan], dtype=dtype)
    values[: len(specials)] = specials[: size]
    cut = None if flat else offsets
    assert encode_float_lists(values, cut) == float_lists2json(values, cut)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e6]))
def test_float32_values_equal_the_reference(seed, scale):
    """float32 values of ordinary sizes: their exact decimals often end in 5, where two
    17-digit strings read back to the same double and Python writes the one rounded to even."""
    values = (np.random.default_rng(seed).normal(size=64) * scale).astype(np.float32)
    assert encode_float_lists(values) == float_lists2json(values)


def test_logprob_shaped_values_equal_the_reference():
    """The values servers write: float32 log-probabilities from log-softmax."""
    logits = np.random.default_rng(3).normal(size=(6, 40)).astype(np.float32)
    logps = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32).ravel()
    offsets = np.arange(0, 241, 40, dtype=np.int64)
    assert encode_float_lists(logps, offsets) == float_lists2json(logps, offsets)
    assert json.loads(encode_float_lists(logps)) == logps.tolist()


@pytest.mark.parametrize("offsets, n", [([], 0), ([1, 2], 2), ([0, 2, 1, 3], 3), ([0, 2], 3), ([0, 4], 3)])
def test_bad_offsets_are_refused_like_the_reference(offsets, n):
    values = np.arange(n, dtype=np.int32)
    for encode in (encode_int_lists, int_lists2json, encode_float_lists, float_lists2json):
        with pytest.raises(ValueError):
            encode(values.astype(np.float32) if "float" in encode.__name__ else values, np.array(offsets))


HOSTILE = [
    "", "[", "]", "[[1,2]", "[1,2]", "[[1.0]]", "[[true]]", "[[null]]", "[[[1]]]", "{\"a\":[1]}",
    "[[2147483648]]", "[[-2147483649]]", "[[1e3]]", "[[\"1\"]]", "[[1],]", "NaN", "[[1]] x", "\x00",
    "[[" * 10_000, "[[1" + ",1" * 5 + "]" * 3,
]


@pytest.mark.parametrize("text", HOSTILE)
def test_the_decoder_refuses_hostile_text(text):
    with pytest.raises(ValueError):
        decode_int_lists(text)


@SETTINGS
@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=60)))
def test_the_decoder_raises_only_value_errors(text):
    """Any text or bytes: a ValueError or a well-formed (values, offsets) pair, nothing else."""
    try:
        values, offsets = decode_int_lists(text)
    except ValueError:
        return
    assert values.dtype == np.int32 and offsets[0] == 0 and offsets[-1] == len(values)
    assert np.all(np.diff(offsets) >= 0)


@SETTINGS
@given(rows=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6), max_size=8),
       spaces=st.booleans())
def test_the_decoder_reads_any_json_writer(rows, spaces):
    """Clients' JSON (spaces or not) of valid rows reads back exactly."""
    text = json.dumps(rows) if spaces else json.dumps(rows, separators=(",", ":"))
    values, offsets = decode_int_lists(text)
    assert [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == rows
