"""SGLang 0.5.23's native /generate and /abort_request (its `srt/managers/io_struct.py` and
`srt/sampling/sampling_params.py`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams
from r3srv.server.rows_encoding import RequestedEncoding
from r3srv.server.protocol.common import MAX_N, NonNegInt, Seed


class SglangSamplingParams(Struct, kw_only=True):
    """SGLang's sampling_params, the fields r3srv serves (server/fields.py refuses the others)."""

    max_new_tokens: NonNegInt | None = 128  # 0: the prompt alone (slime's teacher logprobs)
    min_new_tokens: NonNegInt = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    sampling_seed: Seed | None = None
    no_stop_trim: bool = False
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # SGLang's: on the output tokens only, in (0, 2]
    logit_bias: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.repetition_penalty <= 2.0:  # SGLang's own bound
            raise InvalidRequestError(param="repetition_penalty",
                                      problem=f"={self.repetition_penalty} must be in (0, 2] (1.0 = no penalty)")


# The engine's names -> SGLang's (the prompt's, text or input_ids, is added per request)
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
    "logprobs": "top_logprobs_num",
    "routed_experts_prompt_start": "routed_experts_start_len",
    "prompt_logprobs_start": "logprob_start_len",
}


class SglangGenerateRequest(Struct, kw_only=True):
    """SGLang's GenerateReqInput: one prompt (`text` or `input_ids`) or a batch of them (a list
    of texts or of token-id lists), answered with one output object or, for a batch or n > 1,
    a list (prompt-major, as SGLang). Routed experts come back in meta_info, from
    `routed_experts_start_len` on, by default as SGLang sends them (base64 of little-endian int32,
    no header; server/rows_encoding.py)."""

    # msgspec allows one array-like type per union: a list of token ids or a batch of token-id
    # lists are sorted out by `prompts()`
    text: str | list[str] | None = None
    input_ids: list[NonNegInt | list[NonNegInt]] | None = None
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] = msgspec.field(
        default_factory=SglangSamplingParams
    )
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    # With return_logprob: input_token_logprobs (and input_top_logprobs) from this prompt token
    # on (that first one has none, as SGLang sends it); -1: none.
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    top_logprobs_num: Annotated[int, Meta(ge=0, le=20)] = 0
    return_routed_experts: bool | None = None
    routed_experts_start_len: NonNegInt = 0
    routed_experts_encoding: RequestedEncoding = None  # r3srv's
    # prefix-cache isolation: requests share cached prefixes only with equal keys and salts
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    # the LoRA adapter each prompt runs under, by the name it was loaded with (SGLang's lora_path)
    lora_path: str | list[str | None] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError(param="text", problem=": give exactly one of text and input_ids")

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    def prompts(self) -> list[str | list[int]]:
        name = "text" if self.text is not None else "input_ids"
        prompts: list[Any] = [self.text] if isinstance(self.text, str) else list(self.text or [])
        if self.input_ids is not None:
            nested = [isinstance(p, list) for p in self.input_ids]
            if any(nested) and not all(nested):
                raise InvalidRequestError(param=name, problem=" must be a list of token ids or a list of such lists")
            prompts = list(self.input_ids) if all(nested) and nested else [list(self.input_ids)]
        if not prompts:
            raise InvalidRequestError(param=name, problem=" must not be an empty batch")
        count = len(prompts)
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != count:
            raise InvalidRequestError(param="sampling_params",
                                      problem=f" has {len(self.sampling_params)} entries for {count} prompts")
        if isinstance(self.rid, list) and len(self.rid) != count:
            raise InvalidRequestError(param="rid", problem=f" has {len(self.rid)} entries for {count} prompts")
        return prompts

    def request_ids(self, count: int, default: str) -> list[str]:
        if isinstance(self.rid, list):
            return list(self.rid)
        base = self.rid or default
        return [base] if count == 1 and not self.is_batch else [f"{base}-{i}" for i in range(count)]

    def param_names(self) -> dict[str, str]:
        return {**_SGLANG_NAMES, "prompt": "text" if self.text is not None else "input_ids"}

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def prefill_only(self, index: int = 0) -> bool:
        """max_new_tokens=0: the engine runs one token, the answer leaves it out (nothing generated)."""
        sp = self.sampling_params[index] if isinstance(self.sampling_params, list) else self.sampling_params
        return sp.max_new_tokens == 0

    def lora(self, index: int) -> str | None:
        """The adapter prompt `index` runs under (a list gives one per prompt)."""
        if isinstance(self.lora_path, list):
            if len(self.lora_path) <= index:
                raise InvalidRequestError(param="lora_path", problem=f" has {len(self.lora_path)} entries, fewer "
                                          "than the prompts")
            return self.lora_path[index]
        return self.lora_path

    def _salt(self, index: int) -> str | None:
        """extra_key and cache_salt as one engine salt that vLLM's rules accept (SGLang takes any
        string; "" is none, as in SGLang)."""
        parts = [v[index] if isinstance(v, list) else v for v in (self.extra_key, self.cache_salt)]
        if not any(parts):
            return None
        return hashlib.sha256(msgspec.json.encode([p or None for p in parts])).hexdigest()

    def to_sampling_params(self, index: int = 0, room: int | None = None) -> SamplingParams:
        """Prompt `index`'s SamplingParams. `room`: the tokens its prompt leaves within the context;
        max_new_tokens (and min_new_tokens) are clipped to it, as SGLang's scheduler does."""
        sp = self.sampling_params[index] if isinstance(self.sampling_params, list) else self.sampling_params
        max_tokens, min_tokens = sp.max_new_tokens, sp.min_new_tokens
        if max_tokens == 0:
            max_tokens = 1
        if room is not None and room >= 1:
            max_tokens = room if max_tokens is None else min(max_tokens, room)
            min_tokens = min(min_tokens, max_tokens)
        return SamplingParams(
            n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.sampling_seed,
            min_p=sp.min_p, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, repetition_penalty_prompt=False, logit_bias=sp.logit_bias,
            prompt_logprobs=self.top_logprobs_num if self.wants_input_logprobs else None,
            prompt_logprobs_start=max(self.logprob_start_len, 0), cache_salt=self._salt(index),
            max_tokens=max_tokens, min_tokens=min_tokens, stop=sp.stop,
            stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            routed_experts_prompt_start=self.routed_experts_start_len,
            return_routed_experts=self.return_routed_experts,
        )


class SglangAbortRequest(Struct, kw_only=True):
    """SGLang's /abort_request body: one request by its rid, or every request in flight."""

    rid: str = ""
    abort_all: bool = False


class SglangGenerateOutput(Struct, kw_only=True, omit_defaults=True):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None  # streams of a batch (or n > 1): the output's place in the answer list
