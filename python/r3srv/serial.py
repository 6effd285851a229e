"""Routed experts on the wire: base64 text of a ``.npy`` file (README.md, "The routed-experts contract";
docs/encoding.md).

``numpy2base64`` is the pure-Python reference and stays as the oracle. The encoder and
decoder that the server and clients use are the Rust ones in ``r3srv._core``:

- ``encode_routed_experts(array, prompt_start=0, *, json_quoted=False) -> str`` equals
  ``numpy2base64(array[prompt_start:])`` byte for byte, reading rows from the array's own
  memory and writing header and base64 straight into the new str. ``json_quoted=True``
  adds a double quote at each end: the JSON string, ready for ``msgspec.Raw``.
- ``decode_routed_experts(text: str | bytes) -> np.ndarray`` is the inverse; malformed or
  hostile text raises ValueError.
- ``encoder_isa() -> str`` names the base64 kernel both use on this CPU ("avx512vbmi",
  "avx2" or "portable"; settings.base64_isa can ask for a slower one).
"""

from __future__ import annotations

import io

import numpy as np
import pybase64

from r3srv import settings
from r3srv._core import configure_encoder, decode_routed_experts, encode_routed_experts, encoder_isa

__all__ = ["numpy2base64", "encode_routed_experts", "decode_routed_experts", "encoder_isa"]

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
