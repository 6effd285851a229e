"""The Rust encoder against the pure-Python reference: byte for byte, every layout."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from array_layouts import LAYOUTS, layout_view
from gil_check import assert_releases_gil
from r3srv.serial import decode_routed_experts, encode_routed_experts, numpy2base64

NUMERIC = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "g"]
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Subclass(np.ndarray):
    pass


def _assert_same(array: np.ndarray, prompt_start: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # metadata dtypes: np.save warns, we do not
        want = numpy2base64(array[prompt_start:])
    got = encode_routed_experts(array, prompt_start)
    assert type(got) is str
    assert got == want, (array.dtype, array.shape, array.strides, prompt_start)
    # The server's form: the same text as a JSON string literal, for msgspec.Raw.
    quoted = encode_routed_experts(array, prompt_start, json_quoted=True)
    assert type(quoted) is str
    assert quoted == '"' + want + '"', (array.dtype, array.shape, array.strides, prompt_start)


@SETTINGS
@given(
    dtype=st.sampled_from(NUMERIC),
    order=st.sampled_from("<>"),
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    layout=st.sampled_from(LAYOUTS),
    data=st.data(),
)
def test_encoder_equals_reference(dtype, order, shape, layout, data):
    dt = np.dtype(dtype).newbyteorder(order)
    size = int(np.prod(shape))
    raw = np.random.default_rng(size).integers(0, 256, size * dt.itemsize, dtype=np.uint8)
    base = raw.view(dt).reshape(shape)
    array = layout_view(base, layout, data)
    prompt_start = data.draw(st.sampled_from([0, len(array), len(array) // 2, 1 if len(array) else 0]))
    _assert_same(array, prompt_start)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 64])
@pytest.mark.parametrize("dtype", ["u1", "u2", "i4"])
def test_routed_experts_shapes_every_offset(rows, dtype):
    # The server's case: (T, L, K) C-contiguous, every prompt_start from 0 to T.
    array = np.random.default_rng(rows).integers(0, 200, (rows, 5, 3)).astype(dtype)
    for prompt_start in range(rows + 1):
        _assert_same(array, prompt_start)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6).astype("M8[ns]"),
        np.arange(6).astype(">m8[s]").reshape(2, 3).T,
        np.array(["ab", "cde", ""]),
        np.array([b"x", b"yz"]),
        np.zeros(4, "V3"),
        np.zeros((3, 2), np.dtype("u1", metadata={"unit": "expert"})),
        np.array([1.5, 2.5], ">f16") if np.dtype("g").itemsize == 16 else np.array([1.5], "g"),
    ],
    ids=["datetime", "timedelta-F-swapped", "unicode", "bytes", "void", "metadata", "longdouble"],
)
def test_other_plain_dtypes_are_byte_identical(array):
    for prompt_start in range(len(array) + 1):
        _assert_same(array, prompt_start)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(4, [("a", "<i4"), ("b", ">f8")]),
        np.zeros((3, 2), [("x", "u1", (2,))]),
        np.arange(6).reshape(2, 3).view(_Subclass),
    ],
    ids=["structured", "structured-subarray", "matrix-subclass"],
)
def test_structured_and_subclasses_route_to_the_reference(array):
    # Documented in docs/encoding.md: these go through numpy2base64 itself.
    for prompt_start in range(len(array) + 1):
        _assert_same(array, prompt_start)


@pytest.mark.parametrize(
    "shape, strides",
    [((1, 3), (999, 2)), ((3, 1), (2, 777)), ((3, 4), (2, 2)), ((2, 1, 3), (4, 0, 2)), ((4, 3), (0, 2)), ((2, 3), (2, 4))],
    ids=["size1-row-odd-stride", "size1-col-odd-stride", "overlapping", "zero-stride-middle", "zero-stride-rows", "F-order"],
)
def test_unusual_strides(shape, strides):
    # numpy ignores the strides of length-1 axes for contiguity; overlapping and zero strides
    # are neither C nor F and go through the C-order gather.
    array = np.lib.stride_tricks.as_strided(np.arange(200, dtype=np.uint16), shape, strides)
    for prompt_start in range(len(array) + 1):
        _assert_same(array, prompt_start)


def test_prefix_slice_is_read_in_place():
    # A prompt_start slice of a C array is a pointer offset: changing the source changes
    # the output, and the output equals the reference on the mutated array.
    array = np.zeros((10, 4, 2), np.uint8)
    before = encode_routed_experts(array, 3)
    array[5] = 9
    after = encode_routed_experts(array, 3)
    assert before != after
    assert after == numpy2base64(array[3:])


@pytest.mark.parametrize("rows", [8192, 70_000])
def test_large_inputs_match(rows):
    # 70,000 rows x 384 bytes crosses the two-thread threshold.
    array = np.random.default_rng(rows).integers(0, 256, (rows, 48, 8), dtype=np.uint8)
    _assert_same(array, 0)
    _assert_same(array, 1)
    _assert_same(array, rows - 1)


def test_gil_is_released_on_large_inputs():
    array = np.ones((70_000, 48, 8), np.uint8)
    text = assert_releases_gil(lambda: encode_routed_experts(array))
    assert decode_routed_experts(text).sum() == array.size


class TestBadInput:
    array = np.zeros((3, 2, 2), np.uint8)

    @pytest.mark.parametrize("prompt_start", [-1, 4, 10**30, -(10**30)])
    def test_out_of_range_prompt_start_names_both_numbers(self, prompt_start):
        with pytest.raises(ValueError) as err:
            encode_routed_experts(self.array, prompt_start)
        assert str(prompt_start) in str(err.value)
        assert "3" in str(err.value)

    def test_zero_dim_array(self):
        with pytest.raises(ValueError, match="0-d"):
            encode_routed_experts(np.array(5))

    def test_object_array_like_np_save(self):
        with pytest.raises(ValueError, match="allow_pickle=False"):
            encode_routed_experts(np.array([None, 1], dtype=object))
        with pytest.raises(ValueError, match="allow_pickle=False"):
            encode_routed_experts(np.zeros(2, [("a", "O")]))

    @pytest.mark.parametrize("value", [[1, 2], b"abc", None, 3])
    def test_non_array_is_type_error(self, value):
        with pytest.raises(TypeError, match="numpy.ndarray"):
            encode_routed_experts(value)

    def test_non_int_prompt_start_is_type_error(self):
        with pytest.raises(TypeError):
            encode_routed_experts(self.array, 1.5)

    def test_numpy_integer_prompt_start(self):
        assert encode_routed_experts(self.array, np.int64(2)) == numpy2base64(self.array[2:])
