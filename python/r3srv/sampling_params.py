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


# vLLM clamps each logit_bias value into this range.
LOGIT_BIAS_LIMIT = 100.0
# vLLM's cache_salt length rule (entrypoints/generate/base/protocol.py). Its characters are not
# restricted: vLLM 0.33 refuses '@', '/', '\\' and NUL, but the vLLM releases RL frameworks pin
# took them (SkyRL salts with "<model name>@<weight version>"), and r3srv only hashes the salt.
MAX_CACHE_SALT_CHARS = 128


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Field names and rules follow vLLM 0.33's SamplingParams; docs/sampling.md lists them."""

    n: int = 1
    presence_penalty: float = 0.0  # minus this on every token the output already holds
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / it, negative * it
    # False: output tokens only (SGLang's repetition_penalty); vLLM's counts the prompt too.
    repetition_penalty_prompt: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per sampled token; -1: the whole vocabulary
    # Per prompt token (the first has none): its logprob and the top `prompt_logprobs`; -1: all.
    prompt_logprobs: int | None = None
    # First prompt token of prompt_logprobs (SGLang's logprob_start_len); that token has none.
    prompt_logprobs_start: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to +-100)
    skip_special_tokens: bool = True
    # With skip_special_tokens false: false joins consecutive added tokens without a space (vLLM's)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: no text, token ids only (stop strings need text)
    include_stop_str_in_output: bool = False
    # Keep only the last (truncation_side "left") or first ("right") k prompt tokens; -1: as many
    # as the context allows with one token to generate (vLLM's max_model_len - 1).
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # Prefix-cache isolation: only requests with the same salt share cached blocks (vLLM's
    # cache_salt, SGLang's extra_key).
    cache_salt: str | None = None
    # Routed experts (R3): skip this many leading prompt tokens' rows.
    routed_experts_prompt_start: int = 0
    # None: the engine's default (enable_return_routed_experts); False: opt out.
    return_routed_experts: bool | None = None
    # The router's weight of every routed_experts id (float32, the rows' shape): needs the
    # engine's enable_return_routed_expert_weights.
    return_routed_expert_weights: bool = False
    # Each sampled token's sampling mask: the ids the draw could pick, after every filter, and
    # their logprobs. None: the engine's default (return_sampling_mask); False: opt out.
    return_sampling_mask: bool | None = None
    # DeepSeek Sparse Attention's selected key positions per token and indexer layer (needs the
    # engine's enable_return_indexer_topk). None: the engine's flag (vLLM's default); False: opt out.
    return_indexer_topk: bool | None = None
    # skip this many leading prompt tokens' selections (vLLM's indexer_topk_prompt_start)
    indexer_topk_prompt_start: int = 0

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
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"must be <= max_tokens ({self.max_tokens})")
        _check(self.min_p == self.min_p and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(
            0.0 < self.repetition_penalty < math.inf, "repetition_penalty", self.repetition_penalty,
            "must be finite and > 0",
        )
        # the upper bound (the engine's max_logprobs, -1 as the vocabulary) is the engine's check
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= -1, name, value, "must be -1 (the whole vocabulary) or >= 0")
        _check(self.prompt_logprobs_start >= 0, "prompt_logprobs_start", self.prompt_logprobs_start, "must be >= 0")
        self.logit_bias = _clamped_bias(self.logit_bias) if self.logit_bias else None
        _check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= -1,
            "truncate_prompt_tokens", self.truncate_prompt_tokens, "must be -1 or >= 0",
        )
        _check(self.truncation_side in ("left", "right"), "truncation_side", self.truncation_side,
               "must be 'left' or 'right'")
        salt = self.cache_salt
        _check(
            salt is None or 0 < len(salt) <= MAX_CACHE_SALT_CHARS,
            "cache_salt", salt, f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        )
        _check(self.indexer_topk_prompt_start >= 0, "indexer_topk_prompt_start", self.indexer_topk_prompt_start,
               "must be >= 0")
        _check(
            self.routed_experts_prompt_start >= 0,
            "routed_experts_prompt_start",
            self.routed_experts_prompt_start,
            "must be >= 0",
        )
        if self.stop:
            _check(all(self.stop), "stop", self.stop, "must not contain empty strings")
            _check(self.detokenize, "stop", self.stop, "needs detokenize=true (stop strings match text)")

    @property
    def penalized(self) -> bool:
        """Any of presence, frequency or repetition penalty (the sampler needs token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Temperature 0, or too small to divide by (logits / 1e-39 overflow to inf, then NaN)."""
        return self.temperature < GREEDY_TEMPERATURE


def _clamped_bias(bias: dict) -> dict[int, float]:
    """Integer token ids (vLLM converts the OpenAI string keys with int()), values clamped to +-100."""
    bad_keys = []
    out: dict[int, float] = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            bad_keys.append(token)
            continue
        _check(isinstance(value, (int, float)) and value == value, "logit_bias", {token: value}, "values must be numbers")
        out[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    _check(not bad_keys, "logit_bias", bad_keys, "keys cannot be converted to integer token ids")
    return out


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:  # carries the field: the server names it as the client spelled it
        raise InvalidRequestError(param=field, problem=f"={value!r} {rule}")
