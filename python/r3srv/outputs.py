"""What the engine hands back per request (shapes follow vLLM's RequestOutput)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import numpy as np


class OutputKind(enum.Enum):
    """What a request's outputs hold (as vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # one output per step, each with everything generated so far
    # One output per step, each with only what is new since the previous output: per step it
    # costs the new tokens, not the whole output (streaming servers use this).
    DELTA = "delta"
    FINAL_ONLY = "final_only"  # one output, when the request finishes (cumulative)


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens `[start, end)` of a sample were drawn by the weights named `version`
    (vLLM's and SGLang's spans: the same names, end exclusive)."""

    version: str
    start: int
    end: int


@dataclass
class Logprob:
    """One token's logprob at one position, as vLLM's: its rank in the whole vocabulary (1 = the
    most likely) and its text (left None by the engine; the HTTP server fills it)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample. In a DELTA output `text`, `token_ids` and `logprobs` are only what is new;
    `cumulative_logprob`, `finish_reason` and `routed_experts` are whole-sample in every kind."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    # One dict per generated token, as vLLM's: {token_id: Logprob}, the sampled token first (its
    # rank in the whole vocabulary), then the top `logprobs` tokens (ranks 1, 2, ...).
    logprobs: list[dict[int, Logprob]] | None = None
    # (len(prompt) + len(token_ids) - 1 - routed_experts_prompt_start, num_layers, top_k);
    # set only when finished and routed experts were asked for.
    routed_experts: np.ndarray | None = None
    # With return_routed_expert_weights: the router's weight of each id of routed_experts (float32)
    routed_expert_weights: np.ndarray | None = None
    # With return_indexer_topk (DeepSeek-V3.2, GLM-5): int32 (len(prompt) + len(token_ids) - 1 -
    # indexer_topk_prompt_start, indexer layers, index_topk), each token's selected key positions
    # per layer with an indexer, ascending, -1 after them; set only when finished.
    indexer_topk: np.ndarray | None = None
    # With return_sampling_mask: one row per token of token_ids (DELTA: the new ones)
    sampling_mask: SamplingMasks | None = None
    # Times the scheduler preempted this sample for KV blocks (each recomputes its tokens and
    # rows); set when it finishes (verl reads it as vLLM's).
    num_preempted: int = 0
    # Which weights drew which of token_ids (the whole sample's, in order, covering every token;
    # more than one span when an update came while it ran, in keep or retract mode); set when it
    # finishes, as vLLM's. RequestOutput.weight_version is the weights that computed its rows.
    weight_versions: list[WeightVersionSpan] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SamplingMasks:
    """Per output token, the ids its draw could pick after every filter (top-k, top-p, min-p,
    logit bias, bans, penalties), ascending, with their logprobs under the distribution drawn
    from; a greedy pick's is the pick alone, at 0.0. CSR: row i is `[offsets[i], offsets[i + 1])`
    of `token_ids` (int32) and `logprobs` (float32); `offsets` int64, one more than the tokens."""

    token_ids: np.ndarray
    offsets: np.ndarray
    logprobs: np.ndarray

    @classmethod
    def of(cls, rows: list[tuple[np.ndarray, np.ndarray]]) -> "SamplingMasks":
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids, _ in rows], out=offsets[1:])
        if not rows:
            return cls(np.zeros(0, np.int32), offsets, np.zeros(0, np.float32))
        return cls(np.concatenate([ids for ids, _ in rows]).astype(np.int32, copy=False), offsets,
                   np.concatenate([lp for _, lp in rows]).astype(np.float32, copy=False))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def head(self, n: int) -> "SamplingMasks":
        """The first `n` rows."""
        end = self.offsets[n]
        return SamplingMasks(self.token_ids[:end], self.offsets[: n + 1], self.logprobs[:end])

    def concat(self, more: "SamplingMasks") -> "SamplingMasks":
        """These rows, then `more`'s."""
        return SamplingMasks(np.concatenate([self.token_ids, more.token_ids]),
                             np.concatenate([self.offsets, more.offsets[1:] + self.offsets[-1]]),
                             np.concatenate([self.logprobs, more.logprobs]))

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.token_ids[a:b], self.logprobs[a:b]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt token from prompt_logprobs_start on (the
    # first is None), the token's own logprob first, then the top prompt_logprobs, as vLLM's.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The weights every routed-experts row of this request came from (weight updates wait for
    # the requests in flight; a request retracted for one, AsyncLLM.pause_generation, recomputes
    # all its rows on the new weights, though its earlier tokens were sampled on the old: each
    # CompletionOutput.weight_versions says which weights drew which token).
    weight_version: str | None = None
    # The LoRA adapter the request ran under (None: the base model) and that adapter's version
    # (each replacement adds one; a request retracted for a replacement recomputes on the new one).
    lora_name: str | None = None
    lora_version: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Always None: every row, the prompt's included, is in each sample's routed_experts (vLLM
    # 0.33's layout); kept for code written for vLLM releases that split the prompt's rows off.
    prompt_routed_experts: np.ndarray | None = None
    # Each image's patch grid (t, h, w), in prompt order, when the prompt has images: with the
    # expanded prompt_token_ids what a trainer needs to rebuild the input (and its M-RoPE ids)
    image_grid_thw: list[tuple[int, int, int]] | None = None
    image_placeholders: list[tuple[int, int]] | None = None  # each image's (offset, length) in prompt_token_ids


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one (for a consumer that fell behind)."""
    merged = [
        dataclasses.replace(
            n,
            text=o.text + n.text,
            token_ids=o.token_ids + n.token_ids,
            logprobs=None if n.logprobs is None else (o.logprobs or []) + n.logprobs,
            sampling_mask=n.sampling_mask if o.sampling_mask is None or n.sampling_mask is None
            else o.sampling_mask.concat(n.sampling_mask),
        )
        for o, n in zip(older.outputs, newer.outputs, strict=True)
    ]
    return dataclasses.replace(newer, outputs=merged)
