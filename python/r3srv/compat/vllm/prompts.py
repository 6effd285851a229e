"""vLLM's prompt forms (vllm.inputs): a string, token ids, TextPrompt or TokensPrompt dicts,
read into what r3srv's engine takes (a string or token ids) and the params they imply."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import msgspec

from r3srv.errors import InvalidRequestError
from r3srv.sampling_params import SamplingParams


class TextPrompt(TypedDict, total=False):
    prompt: str
    multi_modal_data: Any
    mm_processor_kwargs: Any
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # vLLM carries the text too, for outputs; the ids are what runs
    multi_modal_data: Any
    mm_processor_kwargs: Any
    cache_salt: str


_KEYS = frozenset(TokensPrompt.__annotations__) | frozenset(TextPrompt.__annotations__)


def is_one_prompt(value: Any) -> bool:
    """A single prompt (not a list of them)."""
    if isinstance(value, (str, Mapping)):
        return True
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, numbers.Integral) for t in value)


def read_prompt(prompt: Any, params: SamplingParams | None) -> tuple[str | list[int] | dict, SamplingParams | None]:
    """One vLLM prompt as (r3srv's prompt, the params with its cache_salt); an
    InvalidRequestError names what r3srv does not take (processor kwargs, unknown keys).
    A prompt with multi_modal_data stays a dict (r3srv's LLM takes its images)."""
    if not isinstance(prompt, Mapping):
        return (list(prompt) if not isinstance(prompt, str) else prompt), params
    unknown = sorted(set(prompt) - _KEYS)
    if unknown:
        raise InvalidRequestError(f"prompt keys {unknown} are not vLLM's prompt fields", param=f"prompt.{unknown[0]}")
    if prompt.get("mm_processor_kwargs"):
        raise InvalidRequestError("processor overrides are not supported by r3srv: the checkpoint's "
                                  "preprocessor_config.json decides", param="prompt.mm_processor_kwargs")
    salt = prompt.get("cache_salt")
    if salt is not None:
        params = msgspec.structs.replace(params or SamplingParams(), cache_salt=salt)
    if "prompt_token_ids" in prompt:
        text: str | list[int] = [int(t) for t in prompt["prompt_token_ids"]]
    elif isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
    else:
        raise InvalidRequestError("a prompt dict needs prompt_token_ids (TokensPrompt) or prompt (TextPrompt)",
                                  param="prompt")
    if prompt.get("multi_modal_data"):
        key = "prompt_token_ids" if isinstance(text, list) else "prompt"
        return {key: text, "multi_modal_data": prompt["multi_modal_data"]}, params
    return text, params
