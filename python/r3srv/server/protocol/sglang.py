"""SGLang 0.5.23's native /generate and /abort_request (its `srt/managers/io_struct.py` and
`srt/sampling/sampling_params.py`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from r3srv.server.rows_encoding import RequestedEncoding
from r3srv.server.protocol.common import MAX_N, ExpertWeightsDtype, NonNegInt, Seed


class SglangSamplingParams(Struct, kw_only=True):
    """SGLang's sampling_params, the fields r3srv serves (server/fields.py refuses the others).
    Null is the default, as SGLang's SamplingParams reads it."""

    max_new_tokens: NonNegInt | None = 128  # 0: the prompt alone (slime's teacher logprobs); null: the context
    min_new_tokens: NonNegInt | None = 0
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # SGLang reads n before its defaults: null is refused
    sampling_seed: Seed | None = None
    no_stop_trim: bool | None = False
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0  # SGLang's: on the output tokens only, in (0, 2]
    logit_bias: dict[str, float] | None = None
    # Without effect: SGLang joins specials as its fast tokenizer decodes them, whatever this says
    spaces_between_special_tokens: bool | None = True
    # For a custom logit processor (refused): without effect, but for slime's top-p token ids
    # ({"return_top_p_token_ids": true}: meta_info's top_p_token_ids and top_p_token_offsets)
    custom_params: Any = None

    @property
    def top_p_token_ids(self) -> bool:
        return isinstance(self.custom_params, dict) and bool(self.custom_params.get("return_top_p_token_ids"))

    def __post_init__(self) -> None:
        for f in msgspec.structs.fields(self):  # SGLang's __post_init__: null is the default
            if getattr(self, f.name) is None and f.default is not None:
                setattr(self, f.name, f.default)
        if not 0.0 < self.repetition_penalty <= 2.0:  # SGLang's own bounds (its SamplingParams.verify)
            raise InvalidRequestError(param="repetition_penalty",
                                      problem=f"={self.repetition_penalty} must be in (0, 2] (1.0 = no penalty)")
        if self.top_k == 0:
            raise InvalidRequestError(param="top_k", problem="=0 must be -1 (disable) or at least 1")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(param="min_new_tokens",
                                      problem=f"={self.min_new_tokens} must be <= max_new_tokens ({self.max_new_tokens})")


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


SamplingLogprobsMode = Literal["selected", "support"]


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
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # The logprob fields: one value for every prompt, or (a batch) one per prompt.
    return_logprob: bool | list[bool] | None = None
    return_text_in_logprobs: bool = False  # each logprob entry's third item: the token's text
    # With return_logprob: input_token_logprobs (and input_top_logprobs) from this prompt token
    # on (that first one has none, as SGLang sends it); negative: none.
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: Annotated[int, Meta(le=20)] | list[Annotated[int, Meta(le=20)]] | None = None  # <= 0: none
    # Unset: the server's default (--enable-return-routed-experts); SGLang's type takes no null.
    return_routed_experts: bool | UnsetType = UNSET
    routed_experts_start_len: NonNegInt = 0
    routed_experts_encoding: RequestedEncoding = None  # r3srv's
    # SGLang's proposed field (#23999): meta_info.routed_expert_weights (servers started with
    # --enable-return-routed-expert-weights), sent as float32 or (r3srv's field) bfloat16
    return_routed_expert_weights: bool = False
    # SGLang's (#24392): meta_info.indexer_topk (servers started with --enable-return-indexer-topk)
    return_indexer_topk: bool = False
    routed_expert_weights_dtype: ExpertWeightsDtype = "float32"
    # Each output token's sampling mask and its logprobs in meta_info: with "selected" (the
    # default) the sampled token's logprob under the filtered distribution, with "support" every
    # mask id's; one value for every prompt, or (a batch) one per prompt
    return_sampling_mask: bool | list[bool] | None = None
    sampling_logprobs_mode: SamplingLogprobsMode | list[SamplingLogprobsMode | None] | None = None
    # prefix-cache isolation: requests share cached prefixes only with equal keys and salts
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    # images (vision-language models): one for every prompt, a list for the prompt (a batch: one
    # entry per prompt, each an image or a list); each a data: URI, bare base64, a path or a URL
    # (r3srv/vision/media.py), or {"url": ...}; typed as SGLang's MultimodalDataInputFormat
    image_data: str | dict[str, Any] | list[str | dict[str, Any] | list[str | dict[str, Any]]] | None = None
    # the LoRA adapter each prompt runs under, by the name it was loaded with (SGLang's lora_path)
    lora_path: str | list[str | None] | None = None
    # Without effect on r3srv (logging, tracing, routing metadata), typed as SGLang types them
    log_metrics: bool = True
    no_logs: bool = False
    routing_key: str | None = None
    conversation_id: str | None = None
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.text is None and self.input_ids is None:
            raise InvalidRequestError(param="text", problem=": give text or input_ids")
        for item in _image_items(self.image_data):  # SGLang's classes refuse keys ImageData lacks
            unknown = sorted(item.keys() - _IMAGE_DATA_DEFAULTS.keys() - {"url"}) if isinstance(item, dict) else []
            if unknown:
                raise InvalidRequestError(param="image_data", problem=f": an image has no field {unknown[0]!r}")

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:  # SGLang tokenizes input_ids when both are given
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    def prompts(self) -> list[str | list[int]]:
        name = "input_ids" if self.input_ids is not None else "text"
        prompts: list[Any] = [self.text] if isinstance(self.text, str) else list(self.text or [])
        if self.input_ids is not None:
            if not self.input_ids:
                raise InvalidRequestError(param=name, problem=" cannot be empty")
            nested = [isinstance(p, list) for p in self.input_ids]
            if any(nested) and not all(nested):
                raise InvalidRequestError(param=name, problem=" must be a list of token ids or a list of such lists")
            prompts = list(self.input_ids) if all(nested) else [list(self.input_ids)]
        if not prompts:
            raise InvalidRequestError(param=name, problem=" must not be an empty batch")
        count = len(prompts)
        for field in ("sampling_params", "rid", "extra_key", "cache_salt", "return_logprob", "logprob_start_len",
                      "top_logprobs_num", "return_sampling_mask", "sampling_logprobs_mode"):
            value = getattr(self, field)
            if not isinstance(value, list):
                continue
            if not self.is_batch and field in ("extra_key", "cache_salt"):
                raise InvalidRequestError(param=field, problem=" should be a string for a single request")
            if len(value) != count and (self.is_batch or value):
                raise InvalidRequestError(param=field, problem=f" has {len(value)} entries for {count} prompts")
        return prompts

    def images(self, count: int) -> list[list[str]]:
        """Each prompt's image references, as SGLang normalizes image_data (its names in errors:
        image_data[k] for a single prompt, image_data[i][k] in a batch)."""
        data = self.image_data
        if data is None or data == []:
            return [[] for _ in range(count)]
        if not isinstance(data, list):
            return [[_image_ref(data, "image_data")] for _ in range(count)]
        if not self.is_batch:
            flat = data[0] if len(data) == 1 and isinstance(data[0], list) else data
            return [[_image_ref(item, f"image_data[{k}]") for k, item in enumerate(flat)]]
        if len(data) != count:
            raise InvalidRequestError(param="image_data", problem=f" has {len(data)} entries for {count} prompts")
        return [[_image_ref(item, f"image_data[{i}][{k}]") for k, item in enumerate(entry)]
                if isinstance(entry, list) else ([] if entry is None else [_image_ref(entry, f"image_data[{i}]")])
                for i, entry in enumerate(data)]

    def request_ids(self, count: int, default: str) -> list[str]:
        if isinstance(self.rid, list) and self.rid:
            return list(self.rid)
        base = (self.rid if isinstance(self.rid, str) else None) or default
        return [base] if count == 1 and not self.is_batch else [f"{base}-{i}" for i in range(count)]

    def param_names(self) -> dict[str, str]:
        return {**_SGLANG_NAMES, "prompt": "input_ids" if self.input_ids is not None else "text"}

    def _at(self, field: str, index: int, default: Any) -> Any:
        """A per-prompt field's value for prompt `index` (an empty list for one prompt: the default)."""
        value = getattr(self, field)
        if isinstance(value, list):
            value = value[index] if value else None
        return default if value is None else value

    def logprobs_of(self, index: int) -> tuple[bool, int, int]:
        """Prompt `index`'s (return_logprob, logprob_start_len, top_logprobs_num)."""
        return (bool(self._at("return_logprob", index, False)), self._at("logprob_start_len", index, -1),
                max(self._at("top_logprobs_num", index, 0), 0))

    def sampling_mask_of(self, index: int) -> tuple[bool, str, bool]:
        """Prompt `index`'s (return_sampling_mask, sampling_logprobs_mode, slime's top-p ids)."""
        want, mode = bool(self._at("return_sampling_mask", index, False)), self._at("sampling_logprobs_mode", index, None)
        if mode is not None and not want:  # SGLang's own rule
            raise InvalidRequestError(param="sampling_logprobs_mode",
                                      problem=" can only be set when return_sampling_mask=true")
        return want, mode or "selected", self._sampling(index).top_p_token_ids

    def _check_mask_top_k(self, index: int, cap: int) -> None:
        """SGLang's bound on a masked request: greedy (top_k 1) or 1 < top_k <= the server's cap."""
        sp = self._sampling(index)
        greedy = sp.temperature < GREEDY_TEMPERATURE or sp.top_k == 1
        if not greedy and not 1 < sp.top_k <= cap:
            raise InvalidRequestError(
                param="top_k", problem=f"={sp.top_k}: return_sampling_mask requires top_k=1 for greedy sampling or "
                f"finite 1 < top_k <= {cap}; lower top_k or increase --sampling-mask-max-tokens")

    def _sampling(self, index: int) -> SglangSamplingParams:
        sp = self.sampling_params
        if isinstance(sp, list):  # one per prompt (an empty list for one prompt: the defaults)
            sp = sp[index] if sp else None
        return sp if sp is not None else SglangSamplingParams()

    def prefill_only(self, index: int = 0) -> bool:
        """max_new_tokens=0: the engine runs one token, the answer leaves it out (nothing generated)."""
        return self._sampling(index).max_new_tokens == 0

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

    def to_sampling_params(self, index: int = 0, room: int | None = None, mask_cap: int | None = None) -> SamplingParams:
        """Prompt `index`'s SamplingParams. `room`: the tokens its prompt leaves within the context;
        max_new_tokens (and min_new_tokens) are clipped to it, as SGLang's scheduler does.
        `mask_cap`: the server's --sampling-mask-max-tokens, which bounds a masked request's top_k."""
        sp = self._sampling(index)
        want_mask, _, top_p_ids = self.sampling_mask_of(index)
        if want_mask and mask_cap is not None:
            self._check_mask_top_k(index, mask_cap)
        return_logprob, logprob_start, top = self.logprobs_of(index)
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
            prompt_logprobs=top if return_logprob and logprob_start >= 0 else None,
            prompt_logprobs_start=max(logprob_start, 0) if return_logprob else 0, cache_salt=self._salt(index),
            max_tokens=max_tokens, min_tokens=min_tokens, stop=sp.stop,
            stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            logprobs=top if return_logprob else None,
            routed_experts_prompt_start=self.routed_experts_start_len,
            return_routed_experts=None if self.return_routed_experts is UNSET else self.return_routed_experts,
            return_routed_expert_weights=self.return_routed_expert_weights,
            return_indexer_topk=self.return_indexer_topk,
            return_sampling_mask=want_mask or top_p_ids,
        )


# SGLang's ImageData besides its url, with the values that leave each option off
_IMAGE_DATA_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "detail": ("auto", None), "max_dynamic_patch": (None,), "preprocess_kwargs": (None,), "content_hash": (None,),
    "max_long_side_pixel": (None,),
}


def _image_items(data: Any) -> list[Any]:
    """image_data's items, however nested (an image, a list, a list of lists)."""
    if not isinstance(data, list):
        return [] if data is None else [data]
    return [item for entry in data for item in (entry if isinstance(entry, list) else [entry])]


def _image_ref(item: Any, param: str) -> str:
    if isinstance(item, dict) and isinstance(item.get("url"), str):  # SGLang's ImageData
        for key, off in _IMAGE_DATA_DEFAULTS.items():
            if key in item and item[key] not in off:
                raise InvalidRequestError(param=f"{param}.{key}", problem=" is not supported by r3srv")
        return item["url"]
    if isinstance(item, str):
        return item
    raise InvalidRequestError(param=param, problem=" must be a string (a data: URI, base64, a path or a URL) "
                              "or {\"url\": ...}")


class SglangAbortRequest(Struct, kw_only=True):
    """SGLang's /abort_request body: one request by its rid, or every request in flight."""

    rid: str = ""
    abort_all: bool = False


class SglangGenerateOutput(Struct, kw_only=True, omit_defaults=True):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None  # streams of a batch (or n > 1): the output's place in the answer list
