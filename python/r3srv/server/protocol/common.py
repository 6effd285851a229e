"""Parts every dialect shares: field types, usage, logprobs, the OpenAI-shaped error.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from r3srv.errors import InvalidRequestError

NonNegInt = Annotated[int, Meta(ge=0)]
# how router weights are sent (r3srv.serial.EXPERT_WEIGHT_DTYPES)
ExpertWeightsDtype = Literal["float32", "bfloat16"]
# A count vLLM checks on the raw body before converting it: a number (2.0 is 2), never a string
LogprobCount = Annotated[int, Meta(extra={"convert_strings": False})]
# vLLM bounds seeds to the signed 64-bit range
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
# Choices per prompt; every route holds to it (a huge n ties the engine up for minutes).
MAX_N = 128
ChoiceCount = Annotated[int, Meta(ge=1, le=MAX_N)]
PromptStart = Annotated[
    int, Meta(ge=0, description="Skip the rows of this many leading prompt tokens in routed_experts.")
]
ReturnRoutedExperts = Annotated[
    bool | None,
    Meta(
        description="None: the server default (--enable-return-routed-experts); false: opt out; "
        "true: ask for them (400 if the server was started without the flag)."
    ),
]
ReturnTokenIds = Annotated[
    bool | None, Meta(description="Add prompt_token_ids and token_ids to the response, as vLLM does.")
]



class WeightVersionSpan(Struct, kw_only=True):
    """Output tokens `[start, end)` of a choice were sampled by the weights named `version`
    (vLLM's `weight_versions` entries and SGLang's `meta_info["weight_versions"]` entries)."""

    version: str
    start: int
    end: int


class StreamOptions(Struct, kw_only=True):
    # Unset and false alike leave usage out; an object with no field set is vLLM's "no options".
    include_usage: bool | None | UnsetType = UNSET
    # With include_usage: the usage so far on every chunk too (vLLM's).
    continuous_usage_stats: bool | None | UnsetType = UNSET

    @property
    def continuous(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)

    @property
    def empty(self) -> bool:
        return self.include_usage is UNSET and self.continuous_usage_stats is UNSET


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's field)


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details, as vLLM
    completion_tokens_details: dict[str, int] | None = None  # vLLM sends null


class Logprob(Struct, kw_only=True):
    """One entry of vLLM's prompt_logprobs: {token id: this}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


class ErrorInfo(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorInfo


def _check_logprob_count(name: str, value: int | None) -> None:
    """vLLM's rule for logprobs, top_logprobs and prompt_logprobs: -1 (the whole vocabulary) or
    >= 0 (the server's --max-logprobs bounds both, in the engine)."""
    if value is not None and value < -1:
        raise InvalidRequestError(param=name, problem=f"={value} must be a positive value or -1")


def _check_prompt_logprobs(prompt_logprobs: int | None, stream: bool | None) -> None:
    _check_logprob_count("prompt_logprobs", prompt_logprobs)
    if stream and prompt_logprobs is not None and prompt_logprobs != 0:
        raise InvalidRequestError(param="prompt_logprobs", problem=" are not available when stream=true")
