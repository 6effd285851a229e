"""Every request and response body of the HTTP API, as msgspec Structs.

Field names follow OpenAI's completions/chat API and vLLM 0.33 (its
`entrypoints/openai/*/protocol.py` and `scale_out/token_in_token_out/protocol.py`)
for every field r3srv supports, so clients written for vLLM work unchanged.
Every field the peers define is served here, has no effect, or is refused with a 400 naming
it (`server/fields.py` holds the table); fields neither peer has are ignored, as vLLM does.
Bodies are decoded strictly (`"16"` is not an int, `2.0` is not a token id).

Errors name fields as the client spelled them: each request's `param_names` maps the engine's
names (SamplingParams and prompt checks) to its own.

Each OpenAI request has exactly one `to_sampling_params`: the one road from the
wire to the engine's `SamplingParams`. `/inference/v1/generate` decodes its
`sampling_params` object straight into `SamplingParams`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams
from r3srv.server.rows_encoding import RequestedEncoding, RoutedExpertsValue, SglExt

NonNegInt = Annotated[int, Meta(ge=0)]
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


# ---------------------------------------------------------------- shared parts


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    # With include_usage: the usage so far on every chunk too (vLLM's).
    continuous_usage_stats: bool | None = False

    @property
    def continuous(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


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




# ---------------------------------------------------------------- fields both OpenAI requests share


class _OpenAIRequest(Struct, kw_only=True):
    """The sampling and r3srv fields of /v1/completions and /v1/chat/completions, and their
    common road to SamplingParams (each request adds its own max_tokens and logprobs rules)."""

    model: str | None = None
    n: ChoiceCount = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, as OpenAI's
    user: str | None = None  # no effect, as in vLLM
    # vLLM extras
    min_p: float | None = None
    repetition_penalty: float | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None
    min_tokens: NonNegInt = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    return_token_ids: ReturnTokenIds = None
    routed_experts_prompt_start: PromptStart = 0
    # r3srv extras
    return_routed_experts: ReturnRoutedExperts = None
    routed_experts_encoding: RequestedEncoding = None

    def _sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options can only be set when stream is true", param="stream_options")
        _check_prompt_logprobs(self.prompt_logprobs, self.stream)
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            cache_salt=self.cache_salt,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            routed_experts_prompt_start=self.routed_experts_prompt_start,
            return_routed_experts=self.return_routed_experts,
        )


# ---------------------------------------------------------------- /v1/completions

# msgspec allows one array-like type per union, so the OpenAI prompt forms
# (str, list[str], list[int], list[list[int]]) decode as str | list[...] and are
# sorted out by `prompts()`.
PromptType = str | list[str | int | list[int]]


class CompletionRequest(_OpenAIRequest, kw_only=True):
    prompt: PromptType
    max_tokens: NonNegInt | None = 16  # 0 only with echo: the prompt alone (vLLM's scoring use)
    logprobs: int | None = None  # -1: the whole vocabulary (with --max-logprobs -1)
    # The prompt's text before the completion's (and with logprobs, the prompt's logprobs first).
    echo: bool | None = False

    def param_names(self) -> dict[str, str]:
        return {}  # the engine's names are vLLM's

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or one token-id list each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if all(isinstance(p, list) for p in prompt):
            if not all(prompt):
                raise InvalidRequestError("prompt token lists must not be empty", param="prompt")
            return list(prompt)  # type: ignore[arg-type]
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            param="prompt",
        )

    def to_sampling_params(self) -> SamplingParams:
        _check_logprob_count("logprobs", self.logprobs)
        # as vLLM: echo's logprobs cover the prompt too, with as many top entries
        prompt_logprobs = self.prompt_logprobs
        if (prompt_logprobs is None or self.stream) and self.echo:
            prompt_logprobs = self.logprobs
        elif self.stream:  # a stream sends prompt logprobs only with echo (only 0 passes the checks)
            prompt_logprobs = None
        max_tokens = self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise InvalidRequestError(param="max_tokens", problem="=0 must be at least 1 (0 needs echo=true)")
            max_tokens = 1  # as vLLM: one token is generated, the response shows the prompt alone
        return self._sampling_params(max_tokens=max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0


class CompletionLogProbs(Struct, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionResponseChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: RoutedExpertsValue | None = None
    weight_versions: list[dict[str, Any]] | None = None  # vLLM's, with return_weight_versions (refused)
    # The weights that produced this choice (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    sglext: SglExt | UnsetType = UNSET  # routed_experts_encoding "sglang" (SGLang's place for them)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class CompletionResponseStreamChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    # Only on the final chunk of a choice (the one with finish_reason).
    routed_experts: RoutedExpertsValue | None | UnsetType = UNSET
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on


class CompletionStreamResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    sglext: SglExt | UnsetType = UNSET  # a chunk of its own, as SGLang's


# ---------------------------------------------------------------- /v1/chat/completions


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageParam(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def content_chars(self) -> int:
        """The content's length in characters (how much work rendering and encoding it is)."""
        if isinstance(self.content, list):
            return sum(len(part.text or "") for part in self.content)
        return len(self.content or "")

    def to_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError(
                    param="messages", problem=": only text content parts are supported by r3srv (no multimodal inputs)"
                )
            content = "".join(part.text for part in content)  # type: ignore[misc]
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_OpenAIRequest, kw_only=True):
    messages: Annotated[list[ChatMessageParam], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # -1: the whole vocabulary (with --max-logprobs -1)
    add_generation_prompt: bool = True
    # vLLM's: the last message's content before the reply, when its role is the reply's
    echo: bool = False

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template_dict() for m in self.messages]

    def param_names(self) -> dict[str, str]:
        names = {"prompt": "messages", "logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def to_sampling_params(self) -> SamplingParams:
        _check_logprob_count("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = self.top_logprobs or 0
        # as vLLM: echo asks for the prompt's logprobs, top_logprobs of them
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = top
        if self.stream:  # a chat stream never sends them (only 0 passes the checks)
            prompt_logprobs = None
        return self._sampling_params(
            max_tokens=max_tokens, logprobs=top if self.logprobs else None, prompt_logprobs=prompt_logprobs
        )

    def response_role(self) -> str:
        """The reply's role (vLLM's get_chat_request_role with its default response role)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """What echo puts before the reply: the last message's content when its role is the reply's."""
        if not self.echo or self.messages[-1].role != self.response_role():
            return ""
        content = self.messages[-1].content
        if isinstance(content, list):
            return "\n".join(part.text or "" for part in content)
        return content or ""


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | None = None
    refusal: str | None = None
    annotations: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    reasoning: str | None = None  # vLLM leaves tool_calls out when empty


class DeltaMessage(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatCompletionLogProb(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = msgspec.field(default_factory=list)


class ChatCompletionLogProbs(Struct, kw_only=True):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: RoutedExpertsValue | None = None
    weight_versions: list[dict[str, Any]] | None = None  # vLLM's, with return_weight_versions (refused)
    # The weights that produced this choice (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    sglext: SglExt | UnsetType = UNSET  # routed_experts_encoding "sglang" (SGLang's place for them)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class ChatCompletionResponseStreamChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET
    routed_experts: RoutedExpertsValue | None | UnsetType = UNSET
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on


class ChatCompletionStreamResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    sglext: SglExt | UnsetType = UNSET  # a chunk of its own, as SGLang's


# ---------------------------------------------------------------- /inference/v1/generate (vLLM scale-out)


# SamplingParams' own names are vLLM's, which TITO clients use (inside sampling_params)
_TITO_NAMES = {"prompt": "token_ids"}


class TitoSamplingParams(SamplingParams, kw_only=True, omit_defaults=True):
    """SamplingParams as /inference/v1/generate reads them: without max_tokens, generate up to
    max_model_len - prompt, as vLLM 0.33 does there."""

    max_tokens: int | None = None


class GenerateRequest(Struct, kw_only=True):
    token_ids: Annotated[list[NonNegInt], Meta(min_length=1)]
    sampling_params: TitoSamplingParams
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: ReturnTokenIds = None
    # "tokens": token ids only; "text": also the detokenized text.
    output_mode: Literal["tokens", "text"] = "tokens"
    cache_salt: str | None = None  # vLLM's: top-level here, a SamplingParams field in r3srv's engine
    routed_experts_encoding: RequestedEncoding = None  # r3srv's

    def __post_init__(self) -> None:
        # SamplingParams has no upper bound on n; the OpenAI routes' cap applies here too.
        # (A ValueError here is a msgspec.ValidationError at decode, so a 400.)
        if self.sampling_params.n > MAX_N:
            raise InvalidRequestError(param="n", problem=f"={self.sampling_params.n} must be <= {MAX_N}")
        if self.stream and self.sampling_params.prompt_logprobs:
            raise InvalidRequestError(param="prompt_logprobs", problem=" are not available when stream=true")

    def to_sampling_params(self) -> SamplingParams:
        if self.cache_salt is None:
            return self.sampling_params
        return msgspec.structs.replace(self.sampling_params, cache_salt=self.cache_salt)

    def param_names(self) -> dict[str, str]:
        return _TITO_NAMES


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
    # The weights that produced this choice (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET
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


class GenerateStreamChoice(Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]  # the delta since the previous chunk of this choice
    logprobs: GenerateLogProbs | None = None
    routed_experts: RoutedExpertsValue | None | UnsetType = UNSET
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on
    text: str | UnsetType = UNSET


class GenerateStreamResponse(Struct, kw_only=True):
    request_id: str
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class AbortRequestsRequest(Struct, kw_only=True):
    request_ids: list[str]


# ---------------------------------------------------------------- RL weight updates (SGLang's names)


class UpdateWeightsFromDiskRequest(Struct, kw_only=True):
    model_path: str  # a checkpoint directory of the served architecture, on the server's file system
    abort_all_requests: bool = False  # False: requests in flight finish on the old weights first
    weight_version: str | None = None  # names the new weights in later choices; default: model_path


class UpdateWeightsResponse(Struct, kw_only=True):
    success: bool
    message: str
    weight_version: str


class ResetPrefixCacheResponse(Struct, kw_only=True):
    success: bool
    num_blocks_forgotten: int


class MemoryOccupationRequest(Struct, kw_only=True):
    """SGLang's /release_memory_occupation and /resume_memory_occupation body."""

    tags: list[str] | None = None  # "kv_cache", "weights"; null: both


class MemoryOccupationResponse(Struct, kw_only=True):
    success: bool
    released: list[str]  # what is released after the call


# ---------------------------------------------------------------- SGLang's native /generate


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


class PauseGenerationRequest(Struct, kw_only=True):
    """SGLang's /pause_generation body. abort: end every request in flight; retract: free the
    running sequences' KV (they recompute, on the weights loaded by then, after
    /continue_generation); in_place: keep everything as it is."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class PauseGenerationResponse(Struct, kw_only=True):
    success: bool
    mode: str
    num_aborted: int  # requests ended with finish_reason "abort"
    num_retracted: int  # running sequences whose KV was freed


class ContinueGenerationResponse(Struct, kw_only=True):
    success: bool
    was_paused: bool


class IsPausedResponse(Struct, kw_only=True):
    is_paused: bool
    mode: str | None = None


# ---------------------------------------------------------------- tokenizer, models, version


class TokenizeRequest(Struct, kw_only=True):
    """Either `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True

    def text(self, apply_chat_template: Any) -> str:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if self.prompt is not None:
            return self.prompt
        messages = [m.to_template_dict() for m in self.messages or ()]
        return apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt)


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegInt]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class RoutedExpertsInfo(Struct, kw_only=True):
    num_layers: int
    top_k: int
    num_experts: int
    dtype: str
    moe_layers: list[int]


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "r3srv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # Present when the server returns routed experts (--enable-return-routed-experts).
    routed_experts: RoutedExpertsInfo | UnsetType = UNSET
    # Present with --enable-weight-updates: the weights new requests run on.
    weight_version: str | UnsetType = UNSET


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(Struct, kw_only=True):
    version: str
