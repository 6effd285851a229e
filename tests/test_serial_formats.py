"""Raw numbers and the dict form (r3srv.serial): the Rust writers against the pure-Python
references byte for byte on generated arrays (dtypes, byte orders, layouts, offsets, value
ranges), the strict decoders on their output and on hostile input."""

from __future__ import annotations

import json

import numpy as np
import pybase64
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from array_layouts import LAYOUTS, layout_view
from gil_check import assert_releases_gil
from r3srv.serial import (
    RAW_DTYPES,
    decode_packed,
    decode_raw,
    encode_packed,
    encode_raw,
    packed2json,
    raw2base64,
)
from text_mutations import EDITS, mutated

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOURCES = ["?", "i1", "u1", "<i2", ">u2", ">i4", "<u4", "<i8", ">u8", ">f4", "<f8"]
# the ladders the server uses (prime-rl's, SkyRL's), single types, and floats after integers
LADDERS = [
    ("uint8", "uint16", "int32"), ("uint8", "int16", "int32"), ("int32",), ("uint8",), ("int8", "uint16"),
    ("uint16", "float32"), ("float64",), ("uint64", "int64"),
]


def _values(dtype: np.dtype, size: int, high: int, seed: int) -> np.ndarray:
    """`size` values of `dtype`: integers in [-high, high] within the type's range (so narrow
    targets both fit and overflow), floats from raw bits (NaNs, infinities, subnormals)."""
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        return rng.integers(0, 256, size * dtype.itemsize, dtype=np.uint8).view(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size).astype(dtype)
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -high), min(info.max, high)
    values = rng.integers(lo, hi, size, endpoint=True, dtype=np.int64 if info.min < 0 or info.max < 2**63 else np.uint64)
    values[:1], values[1:2] = hi, lo  # both ends of the range, where the dtype rules switch
    return values.astype(dtype)


def _array(draw_data, source: str, shape: list[int], layout: str, high: int) -> np.ndarray:
    dt = np.dtype(source)
    base = _values(dt, int(np.prod(shape)), high, len(shape) * 1000 + high % 997).reshape(shape)
    return layout_view(base, layout, draw_data)


def _same_outcome(rust, reference):
    """Both raise ValueError, or both return the same str."""
    try:
        want = reference()
    except ValueError:
        with pytest.raises(ValueError):
            rust()
        return None
    got = rust()
    assert type(got) is str
    assert got == want
    return got


# the array half of the generated cases: source dtype, shape, layout, and the draws of layout_view
ARRAYS = dict(source=st.sampled_from(SOURCES), shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
              layout=st.sampled_from(LAYOUTS), data=st.data())


@SETTINGS
@given(target=st.sampled_from(RAW_DTYPES), high=st.sampled_from([1, 127, 255, 300, 40_000, 2**31, 2**63]), **ARRAYS)
def test_raw_equals_reference(source, target, shape, layout, high, data):
    array = _array(data, source, shape, layout, high)
    start = data.draw(st.sampled_from([0, len(array), len(array) // 2]))
    text = _same_outcome(lambda: encode_raw(array, target, start), lambda: raw2base64(array[start:], target))
    if text is not None:
        assert encode_raw(array, target, start, json_quoted=True) == f'"{text}"'
        back = decode_raw(text, target, array.shape[1:] if 0 not in array.shape[1:] else ())
        np.testing.assert_array_equal(back.reshape(array[start:].shape), array[start:].astype(target))


@SETTINGS
@given(ladder=st.sampled_from(LADDERS), high=st.sampled_from([1, 255, 256, 32_767, 32_768, 65_535, 65_536, 2**40]),
       label=st.one_of(st.none(), st.integers(0, 2**40)), **ARRAYS)
def test_packed_equals_reference(source, ladder, shape, layout, high, label, data):
    array = _array(data, source, shape, layout, high)
    start = data.draw(st.sampled_from([0, len(array), 1 if len(array) else 0]))
    text = _same_outcome(lambda: encode_packed(array, ladder, start, start=label),
                         lambda: packed2json(array[start:], ladder, label))
    if text is not None:
        parsed = json.loads(text)
        assert list(parsed) == (["data", "shape", "dtype"] if label is None else ["data", "shape", "start", "dtype"])
        for payload in (text, text.encode(), parsed, {**parsed, "data": memoryview(parsed["data"].encode())}):
            got = decode_packed(payload)
            assert got.start == label
            np.testing.assert_array_equal(got.array, array[start:].astype(parsed["dtype"]))
            assert got.array.dtype.name == parsed["dtype"] and got.array.shape == array[start:].shape


@pytest.mark.parametrize("dtype", ["u1", "u2", "i4"])
def test_routed_experts_rows_every_offset(dtype):
    # The server's case: (T, L, K) C-contiguous, every offset, every encoding it sends.
    array = np.random.default_rng(7).integers(0, 200, (9, 4, 3)).astype(dtype)
    for start in range(len(array) + 1):
        assert encode_raw(array, "int32", start) == raw2base64(array[start:], "int32")
        for ladder in LADDERS[:2]:
            assert encode_packed(array, ladder, start, start=start) == packed2json(array[start:], ladder, start)


@pytest.mark.parametrize("rows", [8192, 70_000])
def test_large_inputs_match(rows):
    array = np.random.default_rng(rows).integers(0, 300, (rows, 48, 8)).astype(np.uint16)
    assert encode_raw(array, "int32", 1) == raw2base64(array[1:], "int32")
    assert encode_packed(array, LADDERS[1], rows - 5, start=3) == packed2json(array[rows - 5:], LADDERS[1], 3)
    assert encode_packed(array[:, :, :2].T, LADDERS[0]) == packed2json(array[:, :, :2].T, LADDERS[0])


def test_gil_is_released_on_large_inputs():
    array = np.ones((70_000, 48, 8), np.uint8)
    text = assert_releases_gil(lambda: encode_raw(array, "int32"))
    assert decode_raw(text, "int32", (48, 8)).sum() == array.size
    assert_releases_gil(lambda: decode_raw(text, "int32"))
    packed = assert_releases_gil(lambda: encode_packed(array.astype(np.uint16) * 300, LADDERS[0]))
    assert decode_packed(packed).array.dtype == np.uint16


class TestBadInput:
    array = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)

    @pytest.mark.parametrize("call", [encode_raw, lambda a, d, s: encode_packed(a, [d], s)])
    def test_errors(self, call):
        with pytest.raises(ValueError, match="prompt_start=4 is out of range"):
            call(self.array, "int32", 4)
        with pytest.raises(ValueError, match="0-d"):
            call(np.array(3), "int32", 0)
        with pytest.raises(ValueError, match="unsupported dtype .float16."):
            call(self.array, "float16", 0)
        with pytest.raises(ValueError, match="unsupported dtype .bool."):
            call(self.array, "bool", 0)
        for array in (np.array([1, None], object), np.zeros(2, "c8"), np.zeros(2, "f2"), np.zeros(2, "M8[s]"),
                      np.zeros(2, [("a", "u1")])):
            with pytest.raises(ValueError, match="reads bool, integer, float32 and float64 arrays"):
                call(array, "int32", 0)
        with pytest.raises(TypeError, match="numpy.ndarray"):
            call([1, 2], "int32", 0)
        with pytest.raises(ValueError, match=r"int64 values in \[-1, 300\] fit none of uint8"):
            call(np.array([-1, 300]), "uint8", 0)
        with pytest.raises(ValueError, match="float64 values cannot be written as int32"):
            call(np.array([1.0]), "int32", 0)

    def test_packed_arguments(self):
        with pytest.raises(ValueError, match="at least one"):
            encode_packed(self.array, [])
        with pytest.raises(TypeError, match="dtype names"):
            encode_packed(self.array, 7)
        with pytest.raises(ValueError, match="start must be a non-negative int"):
            encode_packed(self.array, "uint8", start=-1)

    @pytest.mark.parametrize("text", ["AAAA=", "AA==AAAA", "AAA", "AA\nA", "AAA!", "A===", "AAAAA===", "\u00e9AAA"])
    def test_raw_decoder_rejects_malformed_text(self, text):
        with pytest.raises(ValueError):
            decode_raw(text, "uint8")

    def test_raw_decoder_shape_and_type_checks(self):
        with pytest.raises(ValueError, match="not a whole number of int32"):
            decode_raw("AAAAAAA=", "int32")  # 5 bytes
        with pytest.raises(ValueError, match="whole rows"):
            decode_raw(encode_raw(self.array, "int32"), "int32", (5,))
        with pytest.raises(ValueError, match="trailing_shape"):
            decode_raw("", "int32", (0,))
        with pytest.raises(TypeError, match="str or bytes"):
            decode_raw(bytearray(b"AAAA"), "uint8")

    @pytest.mark.parametrize(
        "payload, match",
        [
            ('{"data":"AAAA","shape":[3]}', "dtype"),
            ('{"data":"AAAA","shape":[3],"dtype":"uint8","extra":1}', "extra"),
            ('{"data":"AAAA","shape":[3],"dtype":"object"}', "not one of"),
            ('{"data":"AAAA","shape":[4],"dtype":"uint8"}', "holds 3"),
            ('{"data":"AAAA","shape":[-3],"dtype":"uint8"}', ">= 0"),
            ('{"data":"AAAA","shape":[true],"dtype":"uint8"}', "Expected `int`"),
            ('{"data":"AAAA","shape":[],"dtype":"uint8"}', "length >= 1"),
            ('{"data":"AAAA","shape":[3],"dtype":"uint8","start":-1}', ">= 0"),
            ('{"data":"AA!A","shape":[3],"dtype":"uint8"}', "invalid base64"),
            ('{"data":3,"shape":[3],"dtype":"uint8"}', "Expected `str`"),
            ('[1, 2]', "Expected `object`"),
            ("{", "truncated"),
            (b"\xff", "not a packed array"),
            (7, "JSON text or a mapping"),
            ({"data": bytearray(b"AA!A"), "shape": [3], "dtype": "uint8"}, "invalid base64"),
            ({"data": "AAAA", "shape": [1, 2**70], "dtype": "uint8"}, "needs 1180591620717411303424"),
        ],
    )
    def test_packed_decoder_rejects(self, payload, match):
        with pytest.raises(ValueError, match=match):
            decode_packed(payload)

    def test_packed_decoder_allowed_dtypes(self):
        text = encode_packed(self.array, "int16")
        assert decode_packed(text, ("uint8", "int16")).array.dtype == np.int16
        with pytest.raises(ValueError, match="not one of uint8, int32"):
            decode_packed(text, ("uint8", "int32"))


@settings(max_examples=400, deadline=None)
@given(dtype=st.sampled_from(RAW_DTYPES), rows=st.integers(0, 30), edits=EDITS, cut=st.integers(0, 100_000),
       as_bytes=st.booleans())
def test_fuzz_raw_decoder_is_value_error_or_exact(dtype, rows, edits, cut, as_bytes):
    """Untrusted text: ValueError, or exactly the numbers a strict base64 decoder reads from it."""
    values = np.random.default_rng(rows).integers(0, 256, rows * 8, dtype=np.uint8)
    text = mutated(pybase64.b64encode(values.tobytes()).decode(), edits, cut, as_bytes)
    try:
        got = decode_raw(text, dtype)
    except ValueError:
        return
    raw = pybase64.b64decode(text, validate=True)  # raises (failing the test) if we accepted what it refuses
    np.testing.assert_array_equal(got, np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(st.sampled_from(["", "AAAA", "AAECAw==", "AQI=", "////"]), _JSON),
    shape=st.one_of(st.lists(st.integers(-2, 6), max_size=4), _JSON),
    dtype=st.one_of(st.sampled_from([*RAW_DTYPES, "bool", "object", "<i4"]), _JSON),
    start=st.one_of(st.integers(-2, 2**70), _JSON),
    drop=st.sets(st.sampled_from(["data", "shape", "dtype", "start"])),
    extra=st.dictionaries(st.text(max_size=6), _JSON, max_size=2),
    as_text=st.booleans(),
)
def test_fuzz_packed_decoder_is_value_error_or_consistent(data, shape, dtype, start, drop, extra, as_text):
    payload = {"data": data, "shape": shape, "dtype": dtype, "start": start, **extra}
    for key in drop:
        payload.pop(key, None)
    try:
        got = decode_packed(json.dumps(payload) if as_text else payload)
    except ValueError:
        return
    # Whatever decodes is exactly the dict's own data, in its shape and dtype.
    assert got.array.dtype.name == payload["dtype"] and list(got.array.shape) == payload["shape"]
    assert got.array.astype(got.array.dtype.newbyteorder("<")).tobytes() == pybase64.b64decode(payload["data"], validate=True)
    assert got.start == payload.get("start")
