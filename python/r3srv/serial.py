"""Arrays on the wire, written by the Rust core in one pass: base64 of a ``.npy`` file (vLLM's
routed experts), base64 of raw little-endian numbers (SGLang's), and the dict form
``{"data", "shape", "start", "dtype"}`` (prime-rl's and SkyRL's).

Each Rust writer has a pure-Python reference here that stays as the oracle (``numpy2base64``,
``raw2base64``, ``packed2json``), and a strict decoder that turns malformed or hostile input into
a ValueError. The npy functions:

- ``encode_routed_experts(array, prompt_start=0, *, json_quoted=False) -> str`` equals
  ``numpy2base64(array[prompt_start:])`` byte for byte, reading rows from the array's own
  memory and writing header and base64 straight into the new str. ``json_quoted=True``
  adds a double quote at each end: the JSON string, ready for ``msgspec.Raw``.
- ``decode_routed_experts(text: str | bytes) -> np.ndarray`` is the inverse; malformed or
  hostile text raises ValueError.
- ``encoder_isa() -> str`` names the base64 kernel both use on this CPU ("avx512vbmi",
  "avx2" or "portable"; settings.base64_isa can ask for a slower one).

Raw numbers and the dict form (any bool, integer, float32 or float64 array, any layout or byte
order; written in C order, little-endian):

- ``encode_raw(array, dtype, prompt_start=0, *, json_quoted=False) -> str`` equals
  ``raw2base64(array[prompt_start:], dtype)``: integers into an integer ``dtype`` that holds
  every value (else ValueError), integers and floats into float types as ``astype`` rounds them,
  never floats into integers. ``decode_raw(text, dtype, trailing_shape)`` is the inverse.
- ``encode_packed(array, dtypes, prompt_start=0, *, start=None) -> str`` equals
  ``packed2json(array[prompt_start:], dtypes, start)``: compact JSON
  ``{"data":"<raw base64>","shape":[..],"start":N,"dtype":"<name>"}`` (``start`` only when
  given), its dtype the first of ``dtypes`` that holds every value. ``decode_packed(payload)``
  is the inverse, for the text or the parsed dict.

Router weights beside the rows (``--enable-return-routed-expert-weights``):

- ``encode_expert_weights(weights, dtype) -> dict``: ``{"data", "shape", "dtype"}``, the data
  ``encode_raw`` of the float32 weights as ``"float32"``, or of their bfloat16 bits (rounded to
  nearest even) as ``"uint16"`` for ``"bfloat16"``. ``decode_expert_weights(payload)`` reads it
  back strictly, as float32.

Ragged per-token lists (sampling masks and their logprobs), as JSON from their CSR form
(``values`` row after row, row i ``values[offsets[i]:offsets[i + 1]]``):

- ``encode_int_lists(values, offsets) -> str`` equals ``int_lists2json``: ``json.dumps`` (compact)
  of the rows as lists of ints (SGLang's ``output_token_sampling_mask``, vLLM's ``sampling_mask``).
- ``encode_float_lists(values, offsets=None) -> str`` equals ``float_lists2json``: the floats as
  one flat list, or the rows as lists (SGLang's ``output_token_sampling_logprobs``), each float
  as Python's ``repr`` writes it.
- ``decode_int_lists(text) -> (values, offsets)`` is the strict inverse of the first: anything
  but a JSON list of lists of int32 ids is a ValueError.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import pybase64

from r3srv import settings
from r3srv._core import (
    configure_encoder,
    decode_raw_base64,
    decode_routed_experts,
    encode_float_lists as _encode_float_lists,
    encode_int_lists as _encode_int_lists,
    encode_packed,
    encode_raw,
    encode_routed_experts,
    encoder_isa,
)

__all__ = [
    "numpy2base64", "encode_routed_experts", "decode_routed_experts", "encoder_isa",
    "RAW_DTYPES", "raw2base64", "encode_raw", "decode_raw",
    "packed2json", "encode_packed", "decode_packed", "PackedArray",
    "encode_int_lists", "int_lists2json", "decode_int_lists", "encode_float_lists", "float_lists2json",
    "EXPERT_WEIGHT_DTYPES", "encode_expert_weights", "decode_expert_weights",
]

# The types raw numbers (and the dict form's data) may be written as.
RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float32", "float64")
# numpy's limit on dimensions
_MAX_NDIM = 64

# The encoder's settings are fixed once per process, before its first use.
_settings = settings.current()
configure_encoder(_settings.encode_threads, _settings.huge_pages, _settings.base64_isa)


def numpy2base64(array: np.ndarray) -> str:
    """Reference encoder: ``np.save(allow_pickle=False)`` into memory, standard base64, ASCII."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return pybase64.b64encode(buf.getvalue()).decode("ascii")


def _encode_reference(array: np.ndarray, prompt_start: int, json_quoted: bool = False) -> str:
    # Called by the Rust encoder for what it does not encode itself: structured and other
    # non-plain dtypes, and ndarray subclasses. prompt_start is already validated.
    text = numpy2base64(array[prompt_start:])
    return f'"{text}"' if json_quoted else text


# ---------------------------------------------------------------- raw numbers and the dict form


def _target(name: str) -> np.dtype:
    if name not in RAW_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: one of {', '.join(RAW_DTYPES)}")
    return np.dtype(name).newbyteorder("<")


def _chosen_dtype(array: np.ndarray, names: Sequence[str]) -> np.dtype:
    """Reference for the Rust rule: the first of `names` that holds every value of `array`."""
    targets = [_target(name) for name in names]
    kind = array.dtype.kind
    if kind not in "biuf" or array.dtype.fields is not None or (kind == "f" and array.dtype.itemsize not in (4, 8)):
        raise ValueError(f"reads bool, integer, float32 and float64 arrays, not {array.dtype.str}")
    for target in targets:
        if target.kind == "f":
            return target
        if kind == "f":
            continue
        info = np.iinfo(target)
        if array.size == 0 or (info.min <= int(array.min()) and int(array.max()) <= info.max):
            return target
    raise ValueError(f"{array.dtype.name} values fit none of {', '.join(names)}")


def raw2base64(array: np.ndarray, dtype: str) -> str:
    """Reference encoder of raw numbers: ``astype`` the little-endian ``dtype`` (after checking
    that every value fits), its bytes in C order, standard base64."""
    target = _chosen_dtype(array, [dtype])
    return pybase64.b64encode(array.astype(target).tobytes(order="C")).decode("ascii")


def packed2json(array: np.ndarray, dtypes: str | Sequence[str], start: int | None = None) -> str:
    """Reference encoder of the dict form: the stdlib's compact JSON of
    ``{"data", "shape", ("start",) "dtype"}``, the data as ``raw2base64``."""
    names = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    target = _chosen_dtype(array, names)
    packed: dict[str, Any] = {"data": raw2base64(array, target.name), "shape": list(array.shape)}
    if start is not None:
        packed["start"] = start
    packed["dtype"] = target.name
    return json.dumps(packed, separators=(",", ":"))


def decode_raw(text: str | bytes, dtype: str, trailing_shape: Sequence[int] = ()) -> np.ndarray:
    """Strict inverse of ``encode_raw``: padded standard base64 of little-endian ``dtype``
    numbers, reshaped to ``(-1, *trailing_shape)``. Malformed text, or a number of values that is
    not a multiple of ``prod(trailing_shape)``, is a ValueError."""
    trailing = tuple(trailing_shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in trailing) or len(trailing) >= _MAX_NDIM:
        raise ValueError(f"trailing_shape must be positive ints, got {trailing_shape!r}")
    flat = decode_raw_base64(text, dtype)
    per = math.prod(trailing)
    if flat.size % per:
        raise ValueError(f"{flat.size} {dtype} values do not make whole rows of shape {trailing}")
    return flat.reshape(-1, *trailing)


class PackedArray(NamedTuple):
    array: np.ndarray
    start: int | None  # the dict's "start" (the first row's token), None where it has none


class _Packed(msgspec.Struct, forbid_unknown_fields=True):
    data: str
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1, max_length=_MAX_NDIM)]
    dtype: str
    start: Annotated[int, msgspec.Meta(ge=0)] | None = None


def decode_packed(payload: str | bytes | Mapping[str, Any], dtypes: Sequence[str] = RAW_DTYPES) -> PackedArray:
    """Strict inverse of ``encode_packed``, for the JSON text or the dict a client parsed (whose
    ``data`` may be a str or bytes-like, as clients that splice it out of the body hold it).
    Unknown or missing keys, wrong types, a dtype outside ``dtypes``, bad base64, or data that
    does not fill ``shape`` exactly are a ValueError."""
    packed, text = _parse_packed(payload, "decode_packed", "a packed array")
    if packed.dtype not in dtypes:
        raise ValueError(f"packed array dtype {packed.dtype!r} is not one of {', '.join(dtypes)}")
    return PackedArray(_filled(text, packed.dtype, packed.shape), packed.start)


def _parse_packed(payload: str | bytes | Mapping[str, Any], caller: str, what: str) -> tuple[_Packed, str | bytes]:
    """The `{data, shape, dtype, start?}` form checked for its keys and types, and its data (a
    client's dict may hold it as bytes-like)."""
    data: Any = None
    try:
        if isinstance(payload, Mapping):
            fields = dict(payload)
            data = fields.get("data")
            if isinstance(data, (bytes, bytearray, memoryview)):
                fields["data"] = ""  # checked as bytes below
            packed = msgspec.convert(fields, _Packed)
        elif isinstance(payload, (str, bytes)):
            packed = msgspec.json.decode(payload, type=_Packed)
        else:
            raise ValueError(f"{caller} expects JSON text or a mapping, got {type(payload).__name__}")
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not {what}: {exc}") from exc
    return packed, bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else packed.data


def _filled(text: str | bytes, raw_dtype: str, shape: list[int]) -> np.ndarray:
    """The base64 `text` of `raw_dtype` values, reshaped to `shape`, which it must fill exactly."""
    flat = decode_raw_base64(text, raw_dtype)
    if flat.size != math.prod(shape):
        raise ValueError(f"packed array holds {flat.size} {raw_dtype} values, its shape {shape} needs "
                         f"{math.prod(shape)}")
    return flat.reshape(shape)


# ---------------------------------------------------------------- ragged lists (sampling masks)


def _offsets(offsets: Any) -> np.ndarray:
    return np.ascontiguousarray(offsets, dtype=np.int64)


def encode_int_lists(values: np.ndarray, offsets: np.ndarray) -> str:
    """Compact JSON of the rows of int32 ``values`` cut by ``offsets`` (Rust; ``int_lists2json``
    is its reference). Offsets that do not start at 0, decrease or miss the end are a ValueError."""
    return _encode_int_lists(np.ascontiguousarray(values, dtype=np.int32), _offsets(offsets))


def encode_float_lists(values: np.ndarray, offsets: np.ndarray | None = None) -> str:
    """Compact JSON of float32 or float64 ``values``: one flat list (``offsets`` None) or the rows
    ``offsets`` cut (Rust; ``float_lists2json`` is its reference)."""
    values = np.asarray(values)
    if values.dtype not in (np.float32, np.float64):
        values = values.astype(np.float64)
    return _encode_float_lists(np.ascontiguousarray(values), None if offsets is None else _offsets(offsets))


def _rows(values: np.ndarray, offsets: np.ndarray) -> list[list[Any]]:
    offsets = [int(o) for o in offsets]
    if not offsets or offsets[0] != 0 or offsets[-1] != len(values) or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"offsets {offsets[:8]}... do not cut {len(values)} values into rows")
    items = values.tolist()
    return [items[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def int_lists2json(values: np.ndarray, offsets: np.ndarray) -> str:
    """Reference of ``encode_int_lists``: the stdlib's compact ``json.dumps`` of the rows."""
    return json.dumps(_rows(np.asarray(values, dtype=np.int32), offsets), separators=(",", ":"))


def float_lists2json(values: np.ndarray, offsets: np.ndarray | None = None) -> str:
    """Reference of ``encode_float_lists``: the stdlib's compact ``json.dumps`` (floats by repr)."""
    values = np.asarray(values)
    obj = values.tolist() if offsets is None else _rows(values, offsets)
    return json.dumps(obj, separators=(",", ":"))


_INT32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


def decode_int_lists(text: str | bytes) -> tuple[np.ndarray, np.ndarray]:
    """Strict inverse of ``encode_int_lists``: ``(values int32, offsets int64)``. Anything but a
    JSON list of lists of int32 numbers (floats, bools, nulls, deeper nesting, ids out of range,
    malformed JSON) is a ValueError."""
    try:
        rows = msgspec.json.decode(text, type=list[list[_INT32]], strict=True)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise ValueError(f"not a JSON list of int32 lists: {exc}") from exc
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.fromiter((v for r in rows for v in r), dtype=np.int32, count=int(offsets[-1]))
    return values, offsets


# The dtypes router weights are sent as, and the raw type each one's bits are written as
EXPERT_WEIGHT_DTYPES = {"float32": "float32", "bfloat16": "uint16"}


def _bfloat16_bits(weights: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (torch's rounding: to nearest, ties to even), as its uint16 bits."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).to(torch.bfloat16).view(
        torch.int16).numpy().view(np.uint16)


def encode_expert_weights(weights: np.ndarray, dtype: str = "float32") -> dict[str, Any]:
    """Router weights (float32 [tokens, layers, top_k]) in the dict form of `dtype`."""
    if dtype not in EXPERT_WEIGHT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: one of {', '.join(EXPERT_WEIGHT_DTYPES)}")
    values = _bfloat16_bits(weights) if dtype == "bfloat16" else weights
    return {"data": encode_raw(values, EXPERT_WEIGHT_DTYPES[dtype]), "shape": list(weights.shape), "dtype": dtype}


def decode_expert_weights(payload: str | bytes | Mapping[str, Any]) -> np.ndarray:
    """Strict inverse of ``encode_expert_weights`` (its dict, or that dict's JSON): float32 of
    the payload's shape; any other form (a `start` too), dtype or number of values is a ValueError."""
    packed, text = _parse_packed(payload, "decode_expert_weights", "a router-weights payload")
    if packed.dtype not in EXPERT_WEIGHT_DTYPES or packed.start is not None:
        raise ValueError(f"unsupported dtype {packed.dtype!r} (one of {', '.join(EXPERT_WEIGHT_DTYPES)}) or a start")
    values = _filled(text, EXPERT_WEIGHT_DTYPES[packed.dtype], packed.shape)
    if packed.dtype == "bfloat16":  # a bfloat16 is a float32's upper half
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)
