"""The field table: what r3srv does with every request field of the peers' APIs.

Each request field that vLLM 0.33 (CompletionRequest, ChatCompletionRequest, the token-in
token-out GenerateRequest and its SamplingParams) or SGLang 0.5.23 (GenerateReqInput and its
sampling_params) defines is, on the matching r3srv route, exactly one of:

- served: a field of r3srv's own request Struct (it works as in the peer);
- without effect: a field whose peer behaviour on a server like r3srv is to do nothing
  (metadata, logging switches);
- refused: a 400 naming the field, unless the client sends null or the peer's default (a few
  refusals accept more values that leave the feature off, e.g. response_format {"type": "text"}).

tests/data/peer_fields.json lists the peers' fields (tools/peer_fields.py extracts them from
the wheels); tests/test_server_fields.py holds this table to it, so a field a peer adds fails
that test until it lands in one of the three. Fields neither peer has are ignored, as vLLM does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from r3srv.errors import InvalidRequestError
from r3srv.server.coerce import StrictFields, coerce

# The nested object of sampling fields (TITO, SGLang): errors name its fields without it, as the peers do
SAMPLING_PARAMS = "sampling_params"



def _same(a: Any, b: Any, exact: bool = False) -> bool:
    """JSON equality: 0 equals 0.0 (unless `exact`), but a bool is no number (`False == 0` in Python)."""
    if isinstance(a, bool) or isinstance(b, bool) or exact:
        return type(a) is type(b) and a == b
    return a == b


@dataclass(frozen=True)
class Refusal:
    reason: str
    off: tuple[Any, ...] = ()  # values, besides null and the peer's default, that leave the feature off
    any_value: bool = False  # refused whatever the value (a key the peer itself refuses there)
    convert_strings: bool = True  # False: the peer checks the raw value before converting it

    def accepts(self, value: Any, default: Any = None, lax: bool = True, nullable: bool = True) -> bool:
        """Whether `value` leaves the feature off. `lax`: converted first as the peer's pydantic
        validation would (`"false"` is false, `"1"` is 1); `nullable`: whether the peer takes null."""
        if self.any_value:
            return False
        if value is None:
            return nullable
        if lax and (self.convert_strings or not isinstance(value, str)):
            for kind in {type(v) for v in (default, *self.off) if isinstance(v, (bool, int, float))}:
                converted = coerce(value, kind)
                if converted is not value:
                    value = converted
                    break
        return _same(value, default, exact=not lax) or any(_same(value, v, exact=not lax) for v in self.off)


MULTIMODAL = Refusal("multimodal inputs other than images (and their options) are not supported by r3srv")
CONSTRAINED = Refusal("constrained decoding (structured outputs, grammars, JSON schemas, regexes) is not supported by r3srv")
BEAM = Refusal("beam search is not supported by r3srv")
DISAGGREGATION = Refusal("prefill/decode disaggregation and KV transfer are not supported by r3srv")
NOT_SUPPORTED = Refusal("is not supported by r3srv")
INTERNAL = Refusal("is an internal field of the peer, not part of r3srv's API")
# vLLM reads -1 as none (its validator sees the raw value: "-1" is refused)
THINKING_BUDGET = Refusal("is not supported by r3srv", off=(-1,), convert_strings=False)
RESPONSE_FORMAT = Refusal(
    "constrained decoding (structured outputs, grammars, JSON schemas, regexes) is not supported by r3srv; "
    "response_format may only be {\"type\": \"text\"}",
    off=({"type": "text"},),
)
STREAM_INTERVAL = Refusal("is not supported by r3srv except 1 (a chunk per step)", off=(1,))

_VLLM_OPENAI_REFUSED: dict[str, Refusal] = {
    "suffix": NOT_SUPPORTED,
    "use_beam_search": BEAM,
    "length_penalty": BEAM,
    "watermarking": NOT_SUPPORTED,
    "allowed_token_ids": NOT_SUPPORTED,
    "logprob_token_ids": NOT_SUPPORTED,
    "bad_words": NOT_SUPPORTED,
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": CONSTRAINED,
    "priority": Refusal("priority scheduling is not supported by r3srv"),
    "session_id": NOT_SUPPORTED,
    "return_token_offsets": NOT_SUPPORTED,
    "mm_payload": MULTIMODAL,
    "return_mm_kwargs": MULTIMODAL,
    "kv_transfer_params": DISAGGREGATION,
    "ec_transfer_params": DISAGGREGATION,
    "vllm_xargs": NOT_SUPPORTED,
    "repetition_detection": NOT_SUPPORTED,
    "thinking_token_budget": THINKING_BUDGET,
    "stream_interval": STREAM_INTERVAL,
}

COMPLETION_REFUSED: dict[str, Refusal] = {
    **_VLLM_OPENAI_REFUSED,
    "prompt_embeds": NOT_SUPPORTED,
}

CHAT_REFUSED: dict[str, Refusal] = {
    **_VLLM_OPENAI_REFUSED,
    "documents": NOT_SUPPORTED,
    "chat_template": Refusal("custom chat templates are not supported by r3srv: the model's own is used"),
    "media_io_kwargs": MULTIMODAL,
    "mm_processor_kwargs": MULTIMODAL,
    "return_prompt_text": NOT_SUPPORTED,
}


TITO_REFUSED: dict[str, Refusal] = {
    "token_offsets": NOT_SUPPORTED,
    "features": MULTIMODAL,
    "reasoning_ended": NOT_SUPPORTED,
    "reasoning_parser_kwargs": NOT_SUPPORTED,
    "parse_context": NOT_SUPPORTED,
    "priority": Refusal("priority scheduling is not supported by r3srv"),
    "kv_transfer_params": DISAGGREGATION,
    "ec_transfer_params": DISAGGREGATION,
}

TITO_SAMPLING_REFUSED: dict[str, Refusal] = {
    "watermarking": NOT_SUPPORTED,
    "prompt_logprob_token_ids": NOT_SUPPORTED,
    "prompt_logprob_start": NOT_SUPPORTED,
    "logprob_token_ids": NOT_SUPPORTED,
    "flat_logprobs": NOT_SUPPORTED,
    "output_kind": Refusal("is chosen by the server (stream or not)"),
    "stream_interval": STREAM_INTERVAL,
    "skip_clone": INTERNAL,
    "output_text_buffer_length": INTERNAL,
    "structured_outputs": CONSTRAINED,
    "allowed_token_ids": NOT_SUPPORTED,
    "extra_args": NOT_SUPPORTED,
    "bad_words": NOT_SUPPORTED,
    "skip_reading_prefix_cache": NOT_SUPPORTED,
    "thinking_token_budget": Refusal("is not supported by r3srv", off=(-1,)),  # converted first here
    "repetition_detection": NOT_SUPPORTED,
    "trace_decode_token_ids": NOT_SUPPORTED,
}

SGLANG_REFUSED: dict[str, Refusal] = {
    "session_id": NOT_SUPPORTED,
    "session_params": NOT_SUPPORTED,
    "input_embeds": NOT_SUPPORTED,
    "positional_embed_overrides": NOT_SUPPORTED,
    **dict.fromkeys(
        ("mm_hashes", "mm_content_hashes", "use_audio_in_video",
         "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
         "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
         "images_config", "mm_processor_kwargs"),
        MULTIMODAL,
    ),
    # AReaL sends image_data: [] with every text-only request (image_data is served: server/images.py)
    **dict.fromkeys(("video_data", "audio_data"), Refusal(MULTIMODAL.reason, off=([],))),
    "watermark": NOT_SUPPORTED,
    "token_ids_logprob": NOT_SUPPORTED,
    "return_flat_raw_top_logprobs": NOT_SUPPORTED,
    "return_flat_raw_output_top_logprobs": NOT_SUPPORTED,
    "return_flat_raw_top_logprobs_b64": NOT_SUPPORTED,
    "return_hidden_states": NOT_SUPPORTED,
    "lora_id": INTERNAL,  # set by SGLang's tokenizer manager from lora_path
    "custom_logit_processor": Refusal("custom logit processors are not supported by r3srv"),
    **dict.fromkeys(
        ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
         "disagg_prefill_dp_rank", "kv_hints"),
        DISAGGREGATION,
    ),
    "routed_dp_rank": Refusal("data parallelism is not supported by r3srv"),
    "data_parallel_rank": Refusal("data parallelism is not supported by r3srv"),
    "http_worker_ipc": INTERNAL,
    "received_time": INTERNAL,
    "background": NOT_SUPPORTED,
    "require_reasoning": NOT_SUPPORTED,
    "max_thinking_tokens": NOT_SUPPORTED,
    "priority": Refusal("priority scheduling is not supported by r3srv"),
    "return_bytes": NOT_SUPPORTED,
    "return_entropy": NOT_SUPPORTED,
    "return_prompt_token_ids": NOT_SUPPORTED,
    "multi_item_delimiter_indices": NOT_SUPPORTED,
    "token_indices_to_pool": NOT_SUPPORTED,
}

# The fields SGLang's JSON contract gate (sglang/api/v1/api_types.py, decode_GenerateRequest) types
# strictly on /generate: no conversion there ("1" is no int), while its other fields get pydantic's.
SGLANG_CONTRACT_FIELDS = frozenset({
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_hidden_states", "return_text_in_logprobs", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "disagg_prefill_dp_rank", "image_data", "mm_hashes", "video_data", "audio_data", "extra_key", "priority",
    "cache_salt", "require_reasoning", "lora_path", "session_params", "kv_hints", "routing_key",
    "max_thinking_tokens", "session_id", "custom_logit_processor", "custom_labels", "images_config",
    "return_prompt_token_ids", "routed_experts_start_len", "return_sampling_mask", "modalities",
})

# Metadata for logs, traces and routers in front of SGLang: nothing to do on r3srv.
SGLANG_WITHOUT_EFFECT = frozenset(
    {"log_metrics", "no_logs", "routing_key", "conversation_id", "custom_labels", "external_trace_header"}
)

# Accepted and without effect: SGLang's fast-tokenizer decoding ignores the first; the second feeds
# custom logit processors, which r3srv refuses (its one key r3srv reads is slime's return_top_p_token_ids)
SGLANG_SAMPLING_WITHOUT_EFFECT = frozenset({"spaces_between_special_tokens", "custom_params"})

SGLANG_SAMPLING_REFUSED: dict[str, Refusal] = {
    "stop_regex": NOT_SUPPORTED,
    "beam_width": BEAM,
    "json_schema": CONSTRAINED,
    "regex": CONSTRAINED,
    "ebnf": CONSTRAINED,
    "structural_tag": CONSTRAINED,
    "stream_interval": STREAM_INTERVAL,
    "watermark": NOT_SUPPORTED,
    # SGLang's own JSON contract refuses these keys, whatever their value
    **dict.fromkeys(
        ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
         "ebnf_full_assistant"),
        Refusal("is an internal field of the peer, not part of r3srv's API", any_value=True),
    ),
}


# The peers' defaults that are not null, for the fields refused here (a client may send them)
_VLLM_OPENAI_DEFAULTS = {
    "use_beam_search": False, "length_penalty": 1.0,
    "bad_words": [], "priority": 0, "return_token_offsets": False,
    "mm_payload": "tensors",
}
COMPLETION_DEFAULTS = _VLLM_OPENAI_DEFAULTS
CHAT_DEFAULTS = _VLLM_OPENAI_DEFAULTS
TITO_DEFAULTS = {"priority": 0}
TITO_SAMPLING_DEFAULTS = {
    "flat_logprobs": False, "output_kind": 0, "skip_clone": False,
    "output_text_buffer_length": 0, "bad_words": [],
}
SGLANG_DEFAULTS = {
    "use_audio_in_video": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "background": False, "require_reasoning": False,
    "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False,
}
SGLANG_SAMPLING_DEFAULTS = {
    "stop_str_max_len": 0, "stop_regex_max_len": 0, "is_normalized": False,
    "ebnf_full_assistant": False,
}


# Refused fields the peer types without null (pydantic refuses `null` there too)
_VLLM_OPENAI_NOT_NULL = frozenset({
    "use_beam_search", "length_penalty", "bad_words", "priority", "mm_payload",
})
CHAT_NOT_NULL = _VLLM_OPENAI_NOT_NULL
TITO_NOT_NULL = frozenset({"priority"})
TITO_SAMPLING_NOT_NULL = frozenset({"flat_logprobs", "output_kind", "skip_clone", "output_text_buffer_length"})
SGLANG_NOT_NULL = frozenset({
    "use_audio_in_video", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_hidden_states",
    "background", "require_reasoning", "return_bytes", "return_entropy",
    "return_prompt_token_ids",
})


@dataclass(frozen=True)
class BodyFields:
    """One request object (a body, or an object nested in it) of one route: which fields its
    Struct serves, which have no effect, which are refused, and the nested objects to check."""

    struct: type[msgspec.Struct]
    refused: Mapping[str, Refusal]
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the peer's non-null defaults
    without_effect: frozenset[str] = frozenset()
    nested: Mapping[str, BodyFields] = field(default_factory=dict)
    # Values are converted as pydantic's lax mode does, but for these fields, which the peer
    # types strictly (all of them when `lax` is False)
    exact: frozenset[str] = frozenset()
    lax: bool = True
    # Keys the peer does not define are a 400 (SGLang's sampling_params), not ignored
    closed: bool = False
    not_null: frozenset[str] = frozenset()  # refused fields whose null the peer refuses too

    @functools.cached_property
    def served(self) -> frozenset[str]:
        # once: msgspec.structs.fields resolves the Struct's type hints on every call, which
        # cost the event loop more than the rest of a request's handling. A field without
        # effect may be in the Struct too, for its type to be checked as the peer checks it.
        return frozenset(f.encode_name for f in msgspec.structs.fields(self.struct)) - self.without_effect

    def strict_fields(self) -> StrictFields:
        """Struct -> the fields decoded without conversion, for this object and its nested ones."""
        own = self.exact if self.lax else self.served | self.exact
        out = {self.struct: own}
        for nested in self.nested.values():
            out.update(nested.strict_fields())
        return out

    def is_exact(self, name: str) -> bool:
        return not self.lax or name in self.exact

    def refusal(self, name: str) -> Refusal | None:
        """The refusal for a field the client sent, or None when it is served or unknown."""
        if name in self.served or name in self.without_effect:
            return None
        return self.refused.get(name)

    def check(self, body: str | bytes) -> None:
        """400 naming the first refused field the body sets (before the body is decoded)."""
        try:
            obj = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not a JSON object: the typed decode that follows says what is wrong
        self._check(obj, "")

    def _check(self, obj: Mapping[str, msgspec.Raw], prefix: str) -> None:
        for name, raw in obj.items():
            refusal = self.refusal(name)
            if refusal is not None:
                value = msgspec.json.decode(raw)
                if not refusal.accepts(value, self.defaults.get(name), lax=not self.is_exact(name),
                                       nullable=name not in self.not_null):
                    reason = refusal.reason
                    problem = f" {reason}" if reason.startswith("is ") else f": {reason}"
                    raise InvalidRequestError(param=prefix + name, problem=problem)
            elif name in self.nested:
                for item in _objects(raw):
                    self.nested[name]._check(item, "" if name == SAMPLING_PARAMS else f"{prefix}{name}.")
            elif self.closed and name not in self.served and name not in self.without_effect:
                raise InvalidRequestError(param=prefix + name, problem=" is not a field of this object (the peer refuses "
                                                                        "unknown keys here)")


def _objects(raw: msgspec.Raw) -> Iterable[Mapping[str, msgspec.Raw]]:
    """A nested object, or each object of a list of them (SGLang's per-prompt sampling_params)."""
    try:
        value = msgspec.json.decode(raw, type=dict[str, msgspec.Raw] | list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
    if isinstance(value, dict):
        return [value]
    return [obj for item in value for obj in _objects(item)]


def _route_fields() -> dict[str, BodyFields]:
    from r3srv.server import protocol as p  # protocol imports nothing of this module's users

    return {
        "completions": BodyFields(p.CompletionRequest, COMPLETION_REFUSED, COMPLETION_DEFAULTS,
                                  not_null=_VLLM_OPENAI_NOT_NULL),
        "chat": BodyFields(p.ChatCompletionRequest, CHAT_REFUSED, CHAT_DEFAULTS,
                           not_null=CHAT_NOT_NULL),
        "tito": BodyFields(
            p.GenerateRequest, TITO_REFUSED, TITO_DEFAULTS, not_null=TITO_NOT_NULL,
            nested={SAMPLING_PARAMS: BodyFields(p.TitoSamplingParams, TITO_SAMPLING_REFUSED, TITO_SAMPLING_DEFAULTS,
                                                not_null=TITO_SAMPLING_NOT_NULL)},
        ),
        "sglang": BodyFields(
            p.SglangGenerateRequest, SGLANG_REFUSED, SGLANG_DEFAULTS, SGLANG_WITHOUT_EFFECT,
            exact=SGLANG_CONTRACT_FIELDS, not_null=SGLANG_NOT_NULL,
            # SGLang's contract types every sampling field strictly and refuses unknown ones
            nested={SAMPLING_PARAMS: BodyFields(p.SglangSamplingParams, SGLANG_SAMPLING_REFUSED,
                                                SGLANG_SAMPLING_DEFAULTS, SGLANG_SAMPLING_WITHOUT_EFFECT,
                                                lax=False, closed=True)},
        ),
        # SkyRL builds vLLM's SamplingParams from the raw JSON: vLLM's fields, no conversion
        "skyrl": BodyFields(
            p.SkyrlGenerateRequest, {}, lax=False,
            nested={SAMPLING_PARAMS: BodyFields(p.SkyrlSamplingParams, TITO_SAMPLING_REFUSED, TITO_SAMPLING_DEFAULTS,
                                                not_null=TITO_SAMPLING_NOT_NULL, lax=False)},
        ),
    }


ROUTE_FIELDS = _route_fields()
# Which peer class each route's objects answer to (tests/data/peer_fields.json's keys).
PEER_CLASSES = {
    ("completions", None): "vllm.CompletionRequest",
    ("chat", None): "vllm.ChatCompletionRequest",
    ("tito", None): "vllm.GenerateRequest",
    ("tito", "sampling_params"): "vllm.SamplingParams",
    ("sglang", None): "sglang.GenerateReqInput",
    ("sglang", "sampling_params"): "sglang.SamplingParams",
}
