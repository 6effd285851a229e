"""What the engine hands back per request (shapes follow vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: logprob}, the sampled token plus the top `logprobs`.
    logprobs: list[dict[int, float]] | None = None
    # (len(prompt) + len(token_ids) - 1 - routed_experts_prompt_start, num_layers, top_k);
    # set only when finished and routed experts were asked for.
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
