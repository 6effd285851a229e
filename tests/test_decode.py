"""The Rust decoder: round trips, and hostile input is a ValueError, never a crash."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3srv.serial import decode_routed_experts, encode_routed_experts, numpy2base64
from text_mutations import EDITS, mutated

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["?", "i1", "<i2", ">i4", "<i8", "u1", ">u2", "<u4", "f2", ">f4", "<f8", "c8", ">c16"]


def _assert_identical(got: np.ndarray, want: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype and got.dtype.str == want.dtype.str
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc")


@SETTINGS
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    fortran=st.booleans(),
    prompt_start=st.integers(0, 6),
)
def test_round_trip(dtype, shape, fortran, prompt_start):
    size = int(np.prod(shape))
    raw = np.random.default_rng(size).integers(0, 256, size * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(shape, order="F" if fortran else "C")
    prompt_start = min(prompt_start, len(array))
    text = encode_routed_experts(array, prompt_start)
    got = decode_routed_experts(text)
    _assert_identical(got, array[prompt_start:])
    assert got.flags.writeable and got.flags.owndata
    # Memory order as np.load gives it (Fortran-ordered payloads stay Fortran-ordered).
    want = array[prompt_start:]
    loaded = np.load(io.BytesIO(base64.b64decode(text)))
    assert (got.flags.c_contiguous, got.flags.f_contiguous) == (loaded.flags.c_contiguous, loaded.flags.f_contiguous)
    # bytes input decodes the same.
    _assert_identical(decode_routed_experts(text.encode("ascii")), want)


@pytest.mark.parametrize(
    "array",
    [np.arange(5).astype("M8[ms]"), np.array(["ab", "c"]), np.array([b"xy"]), np.zeros(2, "V4"), np.zeros((0, 48, 8), "u1")],
    ids=["datetime", "unicode", "bytes", "void", "empty"],
)
def test_round_trip_other_dtypes(array):
    _assert_identical(decode_routed_experts(numpy2base64(array)), array)


def test_decodes_the_reference_and_zero_dim():
    array = np.random.default_rng(0).integers(0, 256, (9, 48, 8), dtype=np.uint8)
    _assert_identical(decode_routed_experts(numpy2base64(array)), array)
    _assert_identical(decode_routed_experts(numpy2base64(np.array(3.5))), np.array(3.5))


def test_large_round_trip():
    array = np.random.default_rng(1).integers(0, 2**16, (20_000, 48, 8), dtype=np.uint16)
    _assert_identical(decode_routed_experts(encode_routed_experts(array, 7)), array[7:])


def _npy(header: str, data: bytes = b"", version: tuple[int, int] = (1, 0)) -> str:
    h = header.encode("latin1")
    pre = b"\x93NUMPY" + bytes(version) + (struct.pack("<H", len(h)) if version == (1, 0) else struct.pack("<I", len(h)))
    return base64.b64encode(pre + h + data).decode()


GOOD = "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 3), }"


def test_hand_written_header_is_accepted():
    got = decode_routed_experts(_npy(GOOD + "\n", bytes(range(12))))
    assert got.shape == (2, 3) and got.dtype == np.dtype("<u2")
    assert got[0, 0] == 256  # bytes 0, 1 little-endian
    v2 = decode_routed_experts(_npy(GOOD, bytes(12), (2, 0)))
    assert v2.shape == (2, 3)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "magic"),
        ("abc", "multiple of 4"),
        ("QUJD", "magic"),
        ("!!!!" * 8, "base64"),
        (_npy(GOOD, bytes(11)), "mismatch"),
        (_npy(GOOD, bytes(13)), "mismatch"),
        (_npy(GOOD.replace("<u2", "|O"), bytes(48)), "dtype"),
        (_npy(GOOD.replace("<u2", "<q9"), bytes(12)), "dtype"),
        (_npy(GOOD.replace("'<u2'", "[('a', '<u2')]"), bytes(12)), "structured"),
        (_npy(GOOD.replace("(2, 3)", "(4294967296, 4294967296, 4294967296)")), "too large|mismatch"),
        (_npy(GOOD.replace("(2, 3)", "(99999999999999999999,)")), "shape"),
        (_npy(GOOD.replace("(2, 3)", "(-1,)")), "shape"),
        (_npy(GOOD.replace("(2, 3)", "(" + "1, " * 65 + ")")), "dimensions"),
        (_npy("__import__('os').system('true')"), "header"),
        (_npy(GOOD, bytes(12), (9, 0)), "version"),
        (_npy(GOOD)[:40], "truncated"),
        (numpy2base64(np.zeros(8, "u1"))[:-4], "mismatch|truncated"),
        (numpy2base64(np.zeros(8, "u1")).rstrip("="), "multiple of 4"),
        ("é" * 8, "ASCII"),
        ("\ud800" * 8, "ASCII"),
    ],
)
def test_hostile_input_is_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        decode_routed_experts(text)


@pytest.mark.parametrize("value", [None, 3, bytearray(b"QUJD"), np.zeros(3)])
def test_non_text_is_type_error(value):
    with pytest.raises(TypeError, match="str or bytes"):
        decode_routed_experts(value)


def _valid_text(rows: int) -> str:
    return numpy2base64(np.arange(rows * 6, dtype="<u2").reshape(rows, 2, 3))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 4),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(list("AZaz09+/=!\n "))), max_size=4),
    cut=st.integers(0, 10_000),
)
def test_fuzz_mutated_text_never_crashes(rows, edits, cut):
    text = list(_valid_text(rows))
    for pos, ch in edits:
        text[pos % len(text)] = ch
    text = "".join(text)[: max(cut, 0) or None]
    try:
        out = decode_routed_experts(text)
    except ValueError:
        return
    # Whatever decodes must be a consistent array over exactly the payload's data bytes.
    assert isinstance(out, np.ndarray)
    assert out.nbytes <= len(text) * 3 // 4


@settings(max_examples=300, deadline=None)
@given(
    header=st.one_of(
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=120),
        st.builds(
            "{{'descr': {!r}, 'fortran_order': {}, 'shape': {!r}, }}".format,
            st.sampled_from(["<u1", "|u1", "<f8", ">c16", "|b1", "|O", "<U3", "<M8[us]", "<x4", ""]),
            st.sampled_from(["True", "False", "1", "None"]),
            st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
        ),
    ),
    data=st.binary(max_size=64),
    version=st.sampled_from([(1, 0), (2, 0), (3, 0)]),
)
def test_fuzz_headers_never_crash(header, data, version):
    try:
        out = decode_routed_experts(_npy(header, data, version))
    except ValueError:
        return
    assert out.nbytes == len(data)


def _assert_value_error_or_numpy(text) -> None:
    """The decoder raises ValueError, or returns what numpy's own np.load reads from the text."""
    try:
        got = decode_routed_experts(text)
    except ValueError:
        return
    try:
        want = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except Exception as exc:  # numpy and binascii refuse bad input with many exception types
        raise AssertionError(f"decoded text numpy refuses ({exc}): {text!r}") from None
    _assert_identical(got, want)


@settings(max_examples=400, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(0, 40),
    edits=EDITS,
    cut=st.integers(0, 100_000),
    as_bytes=st.booleans(),
)
def test_fuzz_decodes_as_numpy_does_or_raises_value_error(dtype, rows, edits, cut, as_bytes):
    """Untrusted text (mutated, inserted into, cut, any code point, str or bytes): the decoder
    either raises ValueError or returns exactly what numpy's own np.load reads from it."""
    array = np.random.default_rng(rows).integers(0, 256, rows * 6 * np.dtype(dtype).itemsize, dtype=np.uint8)
    text = numpy2base64(array.view(dtype).reshape(rows, 2, 3) if rows else array.view(dtype))
    _assert_value_error_or_numpy(mutated(text, edits, cut, as_bytes))


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.binary(max_size=300), st.text(max_size=300)))
def test_fuzz_arbitrary_input_is_value_error_or_numpy(text):
    _assert_value_error_or_numpy(text)
