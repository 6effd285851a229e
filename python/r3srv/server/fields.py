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

# The nested object of sampling fields (TITO, SGLang): errors name its fields without it, as the peers do
SAMPLING_PARAMS = "sampling_params"



def _same(a: Any, b: Any) -> bool:
    """JSON equality: 0 equals 0.0, but a bool is no number (`False == 0` in Python)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


@dataclass(frozen=True)
class Refusal:
    reason: str
    off: tuple[Any, ...] = ()  # values, besides null and the peer's default, that leave the feature off

    def accepts(self, value: Any, default: Any = None) -> bool:
        return value is None or _same(value, default) or any(_same(value, v) for v in self.off)


MULTIMODAL = Refusal("multimodal inputs are not supported by r3srv (text and token ids only)")
CONSTRAINED = Refusal("constrained decoding (structured outputs, grammars, JSON schemas, regexes) is not supported by r3srv")
BEAM = Refusal("beam search is not supported by r3srv")
DISAGGREGATION = Refusal("prefill/decode disaggregation and KV transfer are not supported by r3srv")
NOT_SUPPORTED = Refusal("is not supported by r3srv")
INTERNAL = Refusal("is an internal field of the peer, not part of r3srv's API")
SPACES = Refusal("is not supported by r3srv except true (the default)")
RESPONSE_FORMAT = Refusal(
    "constrained decoding (structured outputs, grammars, JSON schemas, regexes) is not supported by r3srv; "
    "response_format may only be {\"type\": \"text\"}",
    off=({"type": "text"},),
)
STREAM_INTERVAL = Refusal("is not supported by r3srv except 1 (a chunk per step)", off=(1,))
DETOKENIZE = Refusal("is not supported by r3srv except true (the default)")

_VLLM_OPENAI_REFUSED: dict[str, Refusal] = {
    "suffix": NOT_SUPPORTED,
    "use_beam_search": BEAM,
    "length_penalty": BEAM,
    "watermarking": NOT_SUPPORTED,
    "spaces_between_special_tokens": SPACES,
    "allowed_token_ids": NOT_SUPPORTED,
    "logprob_token_ids": NOT_SUPPORTED,
    "bad_words": NOT_SUPPORTED,
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": CONSTRAINED,
    "priority": Refusal("priority scheduling is not supported by r3srv"),
    "session_id": NOT_SUPPORTED,
    "return_tokens_as_token_ids": NOT_SUPPORTED,
    "return_weight_versions": Refusal(
        "is not supported by r3srv: servers started with --enable-weight-updates put weight_version on every choice"
    ),
    "return_token_offsets": NOT_SUPPORTED,
    "mm_payload": MULTIMODAL,
    "return_mm_kwargs": MULTIMODAL,
    "kv_transfer_params": DISAGGREGATION,
    "ec_transfer_params": DISAGGREGATION,
    "vllm_xargs": NOT_SUPPORTED,
    "repetition_detection": NOT_SUPPORTED,
    "thinking_token_budget": NOT_SUPPORTED,
    "stream_interval": STREAM_INTERVAL,
}

COMPLETION_REFUSED: dict[str, Refusal] = {
    **_VLLM_OPENAI_REFUSED,
    "prompt_embeds": NOT_SUPPORTED,
    "add_special_tokens": Refusal("is not supported by r3srv except true (the default for completions)"),
}

CHAT_REFUSED: dict[str, Refusal] = {
    **_VLLM_OPENAI_REFUSED,
    "continue_final_message": NOT_SUPPORTED,
    "add_special_tokens": Refusal("is not supported by r3srv except false (the default for chat)"),
    "documents": NOT_SUPPORTED,
    "chat_template": Refusal("custom chat templates are not supported by r3srv: the model's own is used"),
    "media_io_kwargs": MULTIMODAL,
    "mm_processor_kwargs": MULTIMODAL,
    "return_prompt_text": NOT_SUPPORTED,
}


TITO_REFUSED: dict[str, Refusal] = {
    "token_offsets": NOT_SUPPORTED,
    "features": MULTIMODAL,
    "content_parts": MULTIMODAL,
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
    "detokenize": DETOKENIZE,
    "spaces_between_special_tokens": SPACES,
    "output_kind": Refusal("is chosen by the server (stream or not)"),
    "stream_interval": STREAM_INTERVAL,
    "skip_clone": INTERNAL,
    "output_text_buffer_length": INTERNAL,
    "structured_outputs": CONSTRAINED,
    "allowed_token_ids": NOT_SUPPORTED,
    "extra_args": NOT_SUPPORTED,
    "bad_words": NOT_SUPPORTED,
    "skip_reading_prefix_cache": NOT_SUPPORTED,
    "thinking_token_budget": NOT_SUPPORTED,
    "repetition_detection": NOT_SUPPORTED,
    "trace_decode_token_ids": NOT_SUPPORTED,
}

SGLANG_REFUSED: dict[str, Refusal] = {
    "session_id": NOT_SUPPORTED,
    "session_params": NOT_SUPPORTED,
    "input_embeds": NOT_SUPPORTED,
    "positional_embed_overrides": NOT_SUPPORTED,
    **dict.fromkeys(
        ("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
         "video_config", "modalities", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
         "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
         "images_config", "mm_processor_kwargs"),
        MULTIMODAL,
    ),
    "watermark": NOT_SUPPORTED,
    "token_ids_logprob": NOT_SUPPORTED,
    "return_sampling_mask": NOT_SUPPORTED,
    "sampling_logprobs_mode": NOT_SUPPORTED,
    "return_text_in_logprobs": NOT_SUPPORTED,
    "return_flat_raw_top_logprobs": NOT_SUPPORTED,
    "return_flat_raw_output_top_logprobs": NOT_SUPPORTED,
    "return_flat_raw_top_logprobs_b64": NOT_SUPPORTED,
    "return_hidden_states": NOT_SUPPORTED,
    "return_indexer_topk": NOT_SUPPORTED,
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

# Metadata for logs, traces and routers in front of SGLang: nothing to do on r3srv.
SGLANG_WITHOUT_EFFECT = frozenset(
    {"log_metrics", "no_logs", "routing_key", "conversation_id", "custom_labels", "external_trace_header"}
)

SGLANG_SAMPLING_REFUSED: dict[str, Refusal] = {
    "stop_regex": NOT_SUPPORTED,
    "beam_width": BEAM,
    "json_schema": CONSTRAINED,
    "regex": CONSTRAINED,
    "ebnf": CONSTRAINED,
    "structural_tag": CONSTRAINED,
    "spaces_between_special_tokens": SPACES,
    "stream_interval": STREAM_INTERVAL,
    "custom_params": Refusal("custom parameters (for custom logit processors) are not supported by r3srv"),
    "watermark": NOT_SUPPORTED,
    "stop_strs": INTERNAL,
    "stop_regex_strs": INTERNAL,
    "stop_str_max_len": INTERNAL,
    "stop_regex_max_len": INTERNAL,
    "is_normalized": INTERNAL,
    "ebnf_full_assistant": INTERNAL,
}


# The peers' defaults that are not null, for the fields refused here (a client may send them)
_VLLM_OPENAI_DEFAULTS = {
    "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
    "bad_words": [], "priority": 0, "return_weight_versions": False, "return_token_offsets": False,
    "mm_payload": "tensors",
}
COMPLETION_DEFAULTS = {**_VLLM_OPENAI_DEFAULTS, "add_special_tokens": True}
CHAT_DEFAULTS = {**_VLLM_OPENAI_DEFAULTS, "add_special_tokens": False, "continue_final_message": False}
TITO_DEFAULTS = {"priority": 0}
TITO_SAMPLING_DEFAULTS = {
    "flat_logprobs": False,
    "detokenize": True, "spaces_between_special_tokens": True, "output_kind": 0, "skip_clone": False,
    "output_text_buffer_length": 0, "bad_words": [],
}
SGLANG_DEFAULTS = {
    "use_audio_in_video": False, "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "return_indexer_topk": False, "background": False, "require_reasoning": False,
    "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False,
}
SGLANG_SAMPLING_DEFAULTS = {
    "spaces_between_special_tokens": True, "stop_str_max_len": 0, "stop_regex_max_len": 0, "is_normalized": False,
    "ebnf_full_assistant": False,
}


@dataclass(frozen=True)
class BodyFields:
    """One request object (a body, or an object nested in it) of one route: which fields its
    Struct serves, which have no effect, which are refused, and the nested objects to check."""

    struct: type[msgspec.Struct]
    refused: Mapping[str, Refusal]
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the peer's non-null defaults
    without_effect: frozenset[str] = frozenset()
    nested: Mapping[str, BodyFields] = field(default_factory=dict)

    @functools.cached_property
    def served(self) -> frozenset[str]:
        # once: msgspec.structs.fields resolves the Struct's type hints on every call, which
        # cost the event loop more than the rest of a request's handling
        return frozenset(f.encode_name for f in msgspec.structs.fields(self.struct))

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
                if not refusal.accepts(value, self.defaults.get(name)):
                    reason = refusal.reason
                    problem = f" {reason}" if reason.startswith("is ") else f": {reason}"
                    raise InvalidRequestError(param=prefix + name, problem=problem)
            elif name in self.nested:
                for item in _objects(raw):
                    self.nested[name]._check(item, "" if name == SAMPLING_PARAMS else f"{prefix}{name}.")


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
        "completions": BodyFields(p.CompletionRequest, COMPLETION_REFUSED, COMPLETION_DEFAULTS),
        "chat": BodyFields(p.ChatCompletionRequest, CHAT_REFUSED, CHAT_DEFAULTS),
        "tito": BodyFields(
            p.GenerateRequest, TITO_REFUSED, TITO_DEFAULTS,
            nested={SAMPLING_PARAMS: BodyFields(p.TitoSamplingParams, TITO_SAMPLING_REFUSED, TITO_SAMPLING_DEFAULTS)},
        ),
        "sglang": BodyFields(
            p.SglangGenerateRequest, SGLANG_REFUSED, SGLANG_DEFAULTS, SGLANG_WITHOUT_EFFECT,
            nested={SAMPLING_PARAMS: BodyFields(p.SglangSamplingParams, SGLANG_SAMPLING_REFUSED,
                                                SGLANG_SAMPLING_DEFAULTS)},
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
