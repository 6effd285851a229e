"""Tokenizer, model list and version.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from r3srv.errors import InvalidRequestError
from r3srv.server.protocol.common import NonNegInt
from r3srv.server.protocol.openai import ChatMessageParam


class TokenizeRequest(Struct, kw_only=True):
    """Either `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    # The tokenizer's specials (BOS) around the text; null: vLLM's defaults, true for a prompt and
    # false for messages (their template writes its own)
    add_special_tokens: bool | None = None

    @property
    def with_special_tokens(self) -> bool:
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens

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
