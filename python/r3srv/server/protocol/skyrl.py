"""SkyRL's token-in token-out route, /skyrl/v1/generate (SkyRL's `vllm_server_actor.py` serves it
beside vLLM; its `remote_inference_client.py` calls it whenever routed experts are on).

The body is vLLM's SamplingParams keyword arguments as SkyRL sends them (the peer builds
`SamplingParams(**sampling_params)` from the raw JSON: no conversion, vLLM's defaults);
the answer is one choice with the routed experts always in SkyRL's `{data, shape, dtype}` form.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from r3srv.sampling_params import SamplingParams
from r3srv.server.protocol.common import NonNegInt
from r3srv.server.protocol.tito import TitoSamplingParams
from r3srv.server.rows_encoding import RoutedExpertsValue


class SkyrlSamplingParams(TitoSamplingParams, kw_only=True, omit_defaults=True):
    """vLLM's SamplingParams with its own default of 16 tokens (SkyRL's route builds the class itself)."""

    max_tokens: int | None = 16


class SkyrlGenerateRequest(Struct, kw_only=True):
    token_ids: Annotated[list[NonNegInt], Meta(min_length=1)]
    sampling_params: SkyrlSamplingParams = msgspec.field(default_factory=SkyrlSamplingParams)
    model: str | None = None
    cache_salt: str | None = None  # top level, as SkyRL sends it (vLLM's TokensPrompt field)

    def to_sampling_params(self) -> SamplingParams:
        if self.cache_salt is None:
            return self.sampling_params
        return msgspec.structs.replace(self.sampling_params, cache_salt=self.cache_salt)

    def param_names(self) -> dict[str, str]:
        return {"prompt": "token_ids"}


class SkyrlLogprob(Struct, kw_only=True):
    logprob: float  # the sampled token's, -9999.0 where missing or not finite (SkyRL's floor)


class SkyrlLogprobs(Struct, kw_only=True):
    content: list[SkyrlLogprob]


class SkyrlChoice(Struct, kw_only=True):
    token_ids: list[int]
    finish_reason: str | None
    logprobs: SkyrlLogprobs | None
    routed_experts: RoutedExpertsValue | None  # {"data", "shape", "dtype"} (uint8, int16 or int32)


class SkyrlGenerateResponse(Struct, kw_only=True):
    choices: list[SkyrlChoice]
