"""What the engine core keeps of a request in flight, and what a step hands out: per request an
update (per sample: the new token, how it ended, its rows), failed requests, token counts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from r3srv.engine.input_processor import EngineRequest
from r3srv.engine.sampler import SampleResult
from r3srv.engine.sequence import Sequence
from r3srv.outputs import Logprob


@dataclass(slots=True)
class SeqUpdate:
    """What one sequence gained in one step, or how it ended."""

    index: int
    sample: SampleResult | None = None  # the token sampled this step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # set when it finished and the request asked for them: rows of every token but the last
    routed_experts: np.ndarray | None = None
    routed_expert_weights: np.ndarray | None = None  # and their router weights (float32), when asked
    indexer_topk: np.ndarray | None = None  # the indexer's selections (int32), when asked
    num_preempted: int = 0  # set when it finished: times it was preempted (recomputed)


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    seqs: list[SeqUpdate]
    num_cached_tokens: int
    weight_version: str | None
    arrival_time: float
    first_token_time: float | None
    # the request's prompt logprobs, once all computed (sent once; None otherwise)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora: tuple[str, int] | None = None  # the adapter it runs under: (name, version)


@dataclass
class CoreOutputs:
    updates: list[RequestUpdate] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request_id, error)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def extend(self, other: "CoreOutputs") -> None:
        self.updates += other.updates
        self.failed += other.failed


@dataclass
class CoreRequest:
    """A request in the core: its samples' sequences and what its updates carry."""

    prepared: EngineRequest
    seqs: list[Sequence]
    deferred: list[Sequence] = field(default_factory=list)  # n > 1 samples waiting for sample 0's prompt
    weight_version: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
