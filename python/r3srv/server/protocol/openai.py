"""OpenAI's /v1/completions and /v1/chat/completions, as vLLM 0.33 spells them
(its `entrypoints/openai/*/protocol.py`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams
from r3srv.server.rows_encoding import RequestedEncoding, RoutedExpertsValue, SglExt
from r3srv.server.protocol.tools import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
    ToolChoice,
    message_tool_fields,
)
from r3srv.server.protocol.common import (
    ChoiceCount,
    LogprobCount,
    NonNegInt,
    PromptLogprobs,
    PromptStart,
    ReturnRoutedExperts,
    ReturnTokenIds,
    Seed,
    StreamOptions,
    UsageInfo,
    WeightVersionSpan,
    _check_logprob_count,
    _check_prompt_logprobs,
)


class _OpenAIRequest(Struct, kw_only=True):
    """The sampling and r3srv fields of /v1/completions and /v1/chat/completions, and their
    common road to SamplingParams (each request adds its own max_tokens and logprobs rules)."""

    model: str | None = None
    n: ChoiceCount = 1
    temperature: float | None = None  # vLLM: at most 2
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
    prompt_logprobs: LogprobCount | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None
    min_tokens: NonNegInt = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    # With skip_special_tokens false: false joins consecutive special tokens without spaces
    spaces_between_special_tokens: bool = True
    # Logprob tokens as "token_id:<id>"; null: the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    include_stop_str_in_output: bool = False
    request_id: str | UnsetType = UNSET  # vLLM's is a string (a random one by default): null is refused
    return_token_ids: ReturnTokenIds = None
    # each choice's weight_versions: which weights sampled which of its tokens (vLLM's)
    return_weight_versions: bool = False
    routed_experts_prompt_start: PromptStart = 0
    # vLLM's (#49555): skip this many prompt tokens' indexer_topk (--enable-return-indexer-topk)
    indexer_topk_prompt_start: PromptStart = 0
    # r3srv extra
    return_routed_experts: ReturnRoutedExperts = None
    routed_experts_encoding: RequestedEncoding = None

    def _sampling_params(
        self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream_options.empty and not self.stream:
            raise InvalidRequestError("stream_options can only be set when stream is true", param="stream_options")
        _check_prompt_logprobs(self.prompt_logprobs, self.stream)
        _check_vllm_ranges(self.temperature)
        return SamplingParams(
            n=self.n or 1,
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
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            routed_experts_prompt_start=self.routed_experts_prompt_start,
            return_routed_experts=self.return_routed_experts,
            indexer_topk_prompt_start=self.indexer_topk_prompt_start,
            return_sampling_mask=False,  # no OpenAI choice carries masks (vLLM: TITO only)
        )


def _check_vllm_ranges(temperature: float | None) -> None:
    """vLLM's own bounds that SGLang does not share (SamplingParams holds the common ones)."""
    if temperature is not None and temperature > 2.0:
        raise InvalidRequestError(param="temperature", problem=f"={temperature} must be in [0, 2]")


# ---------------------------------------------------------------- /v1/completions

# msgspec allows one array-like type per union, so the OpenAI prompt forms
# (str, list[str], list[int], list[list[int]]) decode as str | list[...] and are
# sorted out by `prompts()`.
PromptType = str | list[str | int | list[int]]


class CompletionRequest(_OpenAIRequest, kw_only=True):
    prompt: PromptType
    max_tokens: NonNegInt | None = 16  # 0 only with echo: the prompt alone (vLLM's scoring use); null: 16
    logprobs: LogprobCount | None = None  # -1: the whole vocabulary (with --max-logprobs -1)
    # The prompt's text before the completion's (and with logprobs, the prompt's logprobs first).
    echo: bool | None = False
    add_special_tokens: bool = True  # the tokenizer's specials (BOS) around a text prompt

    def __post_init__(self) -> None:
        if self.max_tokens is None:  # vLLM's normalize_null_max_tokens
            self.max_tokens = 16

    def param_names(self) -> dict[str, str]:
        return {}  # the engine's names are vLLM's

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or one token-id list each."""
        prompt = self.prompt
        if prompt == "":
            raise InvalidRequestError("prompt must be provided and non-empty", param="prompt")
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
    # vLLM's (#49555): base64 .npy int32 (tokens, indexer layers, index_topk), with --enable-return-indexer-topk
    indexer_topk: str | UnsetType = UNSET
    weight_versions: list[WeightVersionSpan] | None = None  # vLLM's, with return_weight_versions
    # The weights that computed this choice's rows (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)


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
    indexer_topk: str | UnsetType = UNSET  # with routed_experts, when asked
    weight_versions: list[WeightVersionSpan] | UnsetType = UNSET  # on the final chunk, with return_weight_versions
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)


class CompletionStreamResponse(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    sglext: SglExt | UnsetType = UNSET  # a chunk of its own, as SGLang's


# ---------------------------------------------------------------- /v1/chat/completions


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM 0.33's


class ImageUrl(Struct, kw_only=True):
    url: str  # a data:image/...;base64 URI, file:// or http(s):// (r3srv/vision/media.py)
    detail: str | None = None  # OpenAI's; the checkpoint's preprocessing decides the resolution


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None  # type "image_url" (vision-language models)


class ChatMessageParam(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM 0.33's name)
    reasoning_content: str | None = None  # its older name, as vLLM reads it

    def content_chars(self) -> int:
        """The content's length in characters (how much work rendering and encoding it is)."""
        if isinstance(self.content, list):
            return sum(len(part.text or "") for part in self.content)
        return len(self.content or "")

    def to_template_dict(self, index: int = 0) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined into one string; with
        images, the parts as a list, each image an {"type": "image"} part the template shows as
        its placeholder (vLLM's "openai" content format)."""
        content: Any = self.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (part.type == "text" and part.text is not None
                        or part.type == "image_url" and part.image_url is not None):
                    raise InvalidRequestError(param=f"messages[{index}].content[{j}]",
                                              problem=": only text and image_url content parts are supported by r3srv")
            if any(part.type == "image_url" for part in content):
                content = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                           for part in content]
            else:
                content = "".join(part.text for part in content)  # type: ignore[misc]
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        message.update(message_tool_fields(self.role, self.tool_calls, self.tool_call_id, reasoning))
        return message


class ChatCompletionRequest(_OpenAIRequest, kw_only=True):
    messages: Annotated[list[ChatMessageParam], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    n: ChoiceCount | None = 1  # null: 1
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = 0  # -1: the whole vocabulary (with --max-logprobs -1); null: 0
    # Unset: true, unless continue_final_message
    add_generation_prompt: bool | UnsetType = UNSET
    # The reply continues the last message (its turn left open) instead of starting a new one
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own specials
    # SGLang's chat extensions (miles' session server sends them): the prompt as token ids (the
    # template is not rendered), each choice's SGLang meta_info, no_stop_trim, routed_experts_start_len
    input_ids: Annotated[list[NonNegInt], Meta(min_length=1)] | None = None
    return_meta_info: bool = False
    no_stop_trim: bool = False
    routed_experts_start_len: NonNegInt | None = None
    # vLLM's: the last message's content before the reply, when its role is the reply's
    echo: bool = False

    # tool calling and reasoning (docs/protocol.md, "Tool calling and reasoning")
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (vLLM's default)
    parallel_tool_calls: bool | None = True  # false: the first call only
    include_reasoning: bool = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.top_logprobs is None:  # vLLM's TopLogprobsParam
            self.top_logprobs = 0
        if self.continue_final_message and self.add_generation_prompt is True:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                      param="continue_final_message")
        if self.tools == []:  # vLLM's (and OpenAI's) rule
            raise InvalidRequestError("`tools` must not be an empty array", param="tools")
        if self.return_meta_info and self.stream:  # SGLang's rule
            raise InvalidRequestError("return_meta_info is not supported with streaming: set stream=false",
                                      param="return_meta_info")
        if self.no_stop_trim:  # SGLang's name
            self.include_stop_str_in_output = True
        if self.routed_experts_start_len is not None:  # SGLang's name
            self.routed_experts_prompt_start = self.routed_experts_start_len

    @property
    def generation_prompt(self) -> bool:
        """Whether the template opens the reply's turn (vLLM: unless continue_final_message)."""
        if self.add_generation_prompt is UNSET:
            return not self.continue_final_message
        return bool(self.add_generation_prompt)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]

    def image_refs(self) -> tuple[list[str], list[str]]:
        """The conversation's image URLs in order, and the field each came in."""
        refs, fields = [], []
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type == "image_url" and part.image_url is not None:
                        refs.append(part.image_url.url)
                        fields.append(f"messages[{i}].content[{j}].image_url")
        return refs, fields

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables besides messages: tools, chat_template_kwargs, and
        reasoning_effort (which also turns thinking on or off unless enable_thinking is given),
        as vLLM builds them."""
        kwargs = dict(self.chat_template_kwargs or {})
        clash = sorted(kwargs.keys() & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if clash:
            raise InvalidRequestError(param="chat_template_kwargs", problem=f" may not set {', '.join(clash)}")
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        if self.tools is not None:
            kwargs["tools"] = [tool.template_dict() for tool in self.tools]
        return kwargs

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
        return "assistant" if self.generation_prompt else self.messages[-1].role

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
    tool_calls: list[ToolCall] | UnsetType = UNSET  # vLLM leaves tool_calls out when empty
    reasoning: str | None = None


class DeltaMessage(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = msgspec.field(default_factory=list)


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
    # vLLM's (#49555): base64 .npy int32 (tokens, indexer layers, index_topk), with --enable-return-indexer-topk
    indexer_topk: str | UnsetType = UNSET
    weight_versions: list[WeightVersionSpan] | None = None  # vLLM's, with return_weight_versions
    # The weights that computed this choice's rows (servers started with --enable-weight-updates).
    weight_version: str | UnsetType = UNSET
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)
    meta_info: dict[str, Any] | UnsetType = UNSET  # SGLang's, with return_meta_info


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
    # r3srv's, for a prompt with images: each image's patch grid (t, h, w), in prompt order
    image_grid_thw: list[list[int]] | UnsetType = UNSET


class ChatCompletionResponseStreamChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET
    routed_experts: RoutedExpertsValue | None | UnsetType = UNSET
    indexer_topk: str | UnsetType = UNSET  # with routed_experts, when asked
    weight_versions: list[WeightVersionSpan] | UnsetType = UNSET  # on the final chunk, with return_weight_versions
    weight_version: str | UnsetType = UNSET  # with routed_experts, when weight updates are on
    lora_name: str | UnsetType = UNSET  # the LoRA adapter that produced it (none: the base model)
    lora_version: int | UnsetType = UNSET  # and that adapter's version (each replacement adds one)


class ChatCompletionStreamResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    sglext: SglExt | UnsetType = UNSET  # a chunk of its own, as SGLang's
    image_grid_thw: list[list[int]] | UnsetType = UNSET  # r3srv's, on the first chunk of a prompt with images
