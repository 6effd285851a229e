"""Which encoding of routed experts a response carries (the table is in docs/protocol.md).

The same request field means different things to different clients (`return_routed_experts`
on an OpenAI route is npy for r3srv's and vLLM's clients, `sglext` int32 for SGLang's;
prime-rl's dict and vLLM's npy share /inference/v1/generate), so the encoding is chosen, never
guessed: the request's `routed_experts_encoding`, else the server's `--routed-experts-encoding`,
else ("auto") the route's own peer's. SkyRL's route always sends SkyRL's.

| encoding | the value | whose |
|---|---|---|
| `npy` | base64 of a `.npy` file, dtype by the number of experts | vLLM's (and r3srv's contract) |
| `sglang` | base64 of little-endian int32 rows, no header | SGLang's |
| `prime-rl` | `{"data","shape","start","dtype"}`, dtype uint8, else uint16 (int32 past 65,535) by the largest id | prime-rl's vLLM server's |
| `skyrl` | `{"data","shape","dtype"}`, dtype uint8, else int16, else int32 by the largest id | SkyRL's vLLM server's |

Every value is written by the Rust core (r3srv.serial) as ready JSON text, which the response
embeds with `msgspec.Raw`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import UNSET, Meta, UnsetType

from r3srv.serial import encode_packed, encode_raw, encode_routed_experts

RoutedExpertsEncoding = Literal["npy", "sglang", "prime-rl", "skyrl"]
ENCODINGS: tuple[str, ...] = ("npy", "sglang", "prime-rl", "skyrl")
AUTO = "auto"  # the server default: each route's own peer's encoding

# What each route sends with "auto" (its peer's encoding)
OPENAI_DEFAULT = "npy"  # /v1/completions, /v1/chat/completions, /inference/v1/generate (vLLM's)
SGLANG_DEFAULT = "sglang"  # /generate (SGLang's)
SKYRL = "skyrl"  # /skyrl/v1/generate, whatever was asked

# dtype ladders: the first type that holds the largest id
PRIME_RL_DTYPES = ("uint8", "uint16", "int32")  # prime-rl's rule (it stops at uint16)
SKYRL_DTYPES = ("uint8", "int16", "int32")  # SkyRL's canonical dtype, which its client checks

RequestedEncoding = Annotated[
    RoutedExpertsEncoding | None,
    Meta(description="How routed_experts are encoded in this response (npy, sglang, prime-rl, skyrl); "
         "null: the server's --routed-experts-encoding (docs/protocol.md)."),
]


class RoutedExpertsDict(msgspec.Struct, kw_only=True):
    """The dict form (prime-rl's and SkyRL's), for the response schema; sent as written by the
    Rust core."""

    data: str
    shape: list[int]
    start: int | UnsetType = UNSET  # prime-rl's: the token of the first row
    dtype: str


# A routed_experts value in a response: npy or SGLang text, or the dict form
RoutedExpertsValue = str | RoutedExpertsDict


class SglExt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's response-level extension object on its OpenAI routes (`sglext`), with the rows
    of the request's first choice, as SGLang sends them."""

    routed_experts: str | UnsetType = UNSET


def choose(requested: str | None, server_default: str, route_default: str) -> str:
    """The encoding of one response: the request's, else the server's, else the route's."""
    if requested is not None:
        return requested
    return route_default if server_default == AUTO else server_default


def encode(array: np.ndarray, encoding: str, start: int) -> str:
    """The rows as the JSON text of their value; `start` is the request's prompt offset (the
    token of row 0), which prime-rl's form carries."""
    if encoding == "npy":
        return encode_routed_experts(array, 0, json_quoted=True)
    if encoding == "sglang":
        return encode_raw(array, "int32", 0, json_quoted=True)
    if encoding == "prime-rl":
        return encode_packed(array, PRIME_RL_DTYPES, 0, start=start)
    if encoding == "skyrl":
        return encode_packed(array, SKYRL_DTYPES, 0)
    raise ValueError(f"unknown routed experts encoding {encoding!r}: one of {', '.join(ENCODINGS)}")


def payload_bytes(text: str) -> int:
    """Bytes of the value counted by r3srv_routed_experts_bytes: the base64 of a string value,
    the whole object of a dict."""
    return len(text) - 2 if text.startswith('"') else len(text)
