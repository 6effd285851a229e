"""Per-request sampling settings: the one road from every protocol to the engine.

A msgspec Struct, so the HTTP layer can decode `sampling_params` of
`/inference/v1/generate` straight into it, and so the OpenAI requests' own
`to_sampling_params` build the same type. `__post_init__` runs on both paths:
a bad value is a ValueError (a msgspec.ValidationError when decoding).
"""

from __future__ import annotations

import math

import msgspec

from r3srv.errors import InvalidRequestError

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Routed experts (R3): skip this many leading prompt tokens' rows.
    routed_experts_prompt_start: int = 0
    # None: the engine's default (enable_return_routed_experts); False: opt out.
    return_routed_experts: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", self.seed, "must be a signed 64-bit integer")
        _check(0.0 <= self.temperature < math.inf, "temperature", self.temperature, "must be finite and >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1, 0 (disabled) or positive")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be in [0, 20]")
        _check(
            self.routed_experts_prompt_start >= 0,
            "routed_experts_prompt_start",
            self.routed_experts_prompt_start,
            "must be >= 0",
        )
        if self.stop:
            _check(all(self.stop), "stop", self.stop, "must not contain empty strings")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or too small to divide by (logits / 1e-39 overflow to inf, then NaN)."""
        return self.temperature < GREEDY_TEMPERATURE


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:  # carries the field: the server names it as the client spelled it
        raise InvalidRequestError(param=field, problem=f"={value!r} {rule}")
