"""vLLM 0.33's token-in token-out routes: /inference/v1/generate and /inference/v1/abort_requests
(its `entrypoints/scale_out/token_in_token_out/protocol.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams
from r3srv.server.rows_encoding import RequestedEncoding, RoutedExpertsValue
from r3srv.server.protocol.openai import ChatCompletionLogProbs
from r3srv.server.protocol.common import (
    MAX_N,
    ExpertWeightsDtype,
    NonNegInt,
    PromptLogprobs,
    ReturnTokenIds,
    StreamOptions,
    UsageInfo,
    WeightVersionSpan,
)


# SamplingParams' own names are vLLM's, which TITO clients use (inside sampling_params)
_TITO_NAMES = {"prompt": "token_ids"}


class TitoSamplingParams(SamplingParams, kw_only=True, omit_defaults=True):
    """SamplingParams as /inference/v1/generate reads them: without max_tokens, generate up to
    max_model_len - prompt, as vLLM 0.33 does there; vLLM's temperature bound."""

    max_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature > 2.0:
            raise InvalidRequestError(param="temperature", problem=f"={self.temperature} must be in [0, 2]")


class GenerateRequest(Struct, kw_only=True):
    token_ids: Annotated[list[NonNegInt], Meta(min_length=1)]
    sampling_params: TitoSamplingParams
    request_id: str | UnsetType = UNSET  # vLLM's is a string (a random one by default): null is refused
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: ReturnTokenIds = None
    # "tokens": token ids only; "text": also the detokenized text.
    output_mode: Literal["tokens", "text"] = "tokens"
    cache_salt: str | None = None  # vLLM's: top-level here, a SamplingParams field in r3srv's engine
    routed_experts_encoding: RequestedEncoding = None  # r3srv's
    # r3srv's: how choices' routed_expert_weights are sent (sampling_params.return_routed_expert_weights)
    routed_expert_weights_dtype: ExpertWeightsDtype = "float32"
    # vLLM's raw multimodal input: [{"type": "image_url", "url": ...}], the images of token_ids'
    # placeholders in order (each one image token, or its run already expanded)
    content_parts: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        # SamplingParams has no upper bound on n; the OpenAI routes' cap applies here too.
        # (A ValueError here is a msgspec.ValidationError at decode, so a 400.)
        if self.sampling_params.n > MAX_N:
            raise InvalidRequestError(param="n", problem=f"={self.sampling_params.n} must be <= {MAX_N}")
        if self.stream and self.sampling_params.prompt_logprobs:
            raise InvalidRequestError(param="prompt_logprobs", problem=" are not available when stream=true")
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise InvalidRequestError(param="output_mode",
                                      problem=f"={self.output_mode!r} requires sampling_params.detokenize to be true")

    def to_sampling_params(self) -> SamplingParams:
        if self.cache_salt is None:
            return self.sampling_params
        return msgspec.structs.replace(self.sampling_params, cache_salt=self.cache_salt)

    def param_names(self) -> dict[str, str]:
        return _TITO_NAMES

    def image_refs(self) -> tuple[list[str], list[str]]:
        """content_parts' image URLs in order, and the field each came in."""
        refs, fields = [], []
        for k, part in enumerate(self.content_parts or []):
            if part.get("type") != "image_url":
                raise InvalidRequestError(param=f"content_parts[{k}]",
                                          problem=": only image_url parts are supported by r3srv")
            if not isinstance(part.get("url"), str):  # a uuid alone asks for a cached item r3srv does not keep
                raise InvalidRequestError(param=f"content_parts[{k}].url", problem=" must be a string (the image)")
            refs.append(part["url"])
            fields.append(f"content_parts[{k}].url")
        return refs, fields


class PlaceholderRange(Struct, kw_only=True):
    """vLLM's PlaceholderRangeInfo: an image's placeholder tokens in the prompt."""

    offset: int
    length: int


class GenerateLogProb(Struct, kw_only=True):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(Struct, kw_only=True):
    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[GenerateLogProb] = msgspec.field(default_factory=list)


class GenerateLogProbs(Struct, kw_only=True):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: GenerateLogProbs | None = None
    routed_experts: RoutedExpertsValue | None = None
    # r3srv's (vLLM has none): routed_experts' router weights, r3srv.serial.encode_expert_weights
    routed_expert_weights: dict[str, Any] | None = None
    # vLLM's (#49555): base64 .npy int32 (tokens, indexer layers, index_topk), with --enable-return-indexer-topk
    indexer_topk: str | UnsetType = UNSET
    # vLLM's: per output token, the ids its draw could pick (ascending); the JSON is written by
    # the Rust core and embedded as a msgspec.Raw (typed as what it reads as, for the schema)
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None  # vLLM's: which weights sampled which tokens
    # The weights that computed this choice's rows (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)
    text: str | UnsetType = UNSET  # output_mode="text" only


class GenerateResponse(Struct, kw_only=True):
    request_id: str
    model: str | None = None
    created: int | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, list[PlaceholderRange]] | None = None  # vLLM's: where each image's tokens sit


class GenerateStreamChoice(Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]  # the delta since the previous chunk of this choice
    logprobs: GenerateLogProbs | None = None
    routed_experts: RoutedExpertsValue | None | UnsetType = UNSET
    routed_expert_weights: dict[str, Any] | UnsetType = UNSET  # with routed_experts, when asked
    indexer_topk: str | UnsetType = UNSET  # with routed_experts, when asked
    sampling_mask: list[list[int]] | None = None  # the chunk's tokens' masks (vLLM's)
    weight_versions: list[WeightVersionSpan] | UnsetType = UNSET  # vLLM's, on the final chunk: the whole output's
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)
    text: str | UnsetType = UNSET


class GenerateStreamResponse(Struct, kw_only=True):
    request_id: str
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, list[PlaceholderRange]] | None = None  # on the first chunk


# vLLM 0.33's text-level shapes (GenerateTextChoice, ...): OpenAI's logprob objects. r3srv answers them
# in text mode, and in tokens mode under --generate-logprobs-format openai (vLLM before output_mode).
class GenerateTextChoice(GenerateChoice, kw_only=True):
    logprobs: ChatCompletionLogProbs | None = None


class GenerateTextResponse(GenerateResponse, kw_only=True):
    choices: list[GenerateTextChoice]


class GenerateTextStreamChoice(GenerateStreamChoice, kw_only=True):
    logprobs: ChatCompletionLogProbs | None = None


class GenerateTextStreamResponse(GenerateStreamResponse, kw_only=True):
    choices: list[GenerateTextStreamChoice]


def mm_placeholders(placeholders: list[tuple[int, int]] | None) -> dict[str, list[PlaceholderRange]] | None:
    """vLLM's mm_placeholders of a prompt's images, None without images."""
    if placeholders is None:
        return None
    return {"image": [PlaceholderRange(offset=offset, length=length) for offset, length in placeholders]}


class AbortRequestsRequest(Struct, kw_only=True):
    request_ids: list[str]
