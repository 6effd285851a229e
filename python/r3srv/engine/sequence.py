"""One sampled sequence (a request with n > 1 has n of them) and its KV bookkeeping."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from r3srv.engine.block_table import BlockTable
from r3srv.outputs import Logprob
from r3srv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from r3srv.lora.manager import LoraRef
    from r3srv.vision.inputs import MultiModalPrompt


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_ids = itertools.count()


class Sequence:
    """Token ids (prompt + output) and the KV blocks holding them (text, logprobs and outputs are
    the output processor's).

    Invariant: tokens [0, num_computed_tokens) have their KV (and routed-expert rows)
    in the slots given by `block_table`; the last sampled token is never computed
    until the next step runs it.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        generator: torch.Generator | None,
        multimodal: MultiModalPrompt | None = None,
        lora: LoraRef | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.lora = lora  # the adapter (and its version) it runs under; None: the base model
        self.lora_slot = -1  # the model's slot holding that adapter in the step being prepared
        self.request_id = request_id
        self.index = index  # choice index within its request
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.multimodal = multimodal  # the prompt's images and M-RoPE ids (vision-language models)
        # logit_bias or a penalty: the sampler adjusts this row's logits (checked every step)
        self.adjusts_logits = bool(params.logit_bias) or params.penalized
        self.prompt_token_mask: torch.Tensor | None = None  # [vocab] bool, for vLLM's repetition penalty
        self.max_tokens = max_tokens
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()
        self.block_hashes: list[int] = []  # chain hashes of the leading full, computed blocks
        # (block_id, generation) of the registered block holding each of those prefixes
        # (this sequence's own block, or an equal one registered first)
        self.block_prefix_ids: list[tuple[int, int]] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preempted = 0  # times the scheduler preempted it for blocks (not retractions for an update)
        self.admitted = False
        self.num_scheduled_tokens = 0  # tokens the current step computes
        # hybrid models (engine/state_pool.py): the state slot while admitted; the snapshot entry
        # this sequence owns and the block it is attached to; (position, entry) of the snapshots
        # this step takes; the snapshot a prefix hit restores before the sequence's first step
        self.state_slot = -1
        self.snapshot = -1
        self.snapshot_block: int | None = None
        self.snapshot_plan: list[tuple[int, int]] = []
        self.restore_from = -1
        # How this sequence ends, (finish_reason, stop_reason, the last sample or None), while it
        # waits for the rows of its kept tokens (preempted since, or, with overlapped scheduling,
        # computed by the step in flight): it finishes, sampling nothing, once they are computed.
        self.finish_later: tuple | None = None
        # Prompt logprobs (sample 0 of a request only: they are the request's), one entry per
        # prompt token from params.prompt_logprobs_start on; that first token has none. Kept
        # here (not by the output processor) so a preempted prompt resumes where it left off.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None and index == 0:
            self.prompt_logprobs = [None] if params.prompt_logprobs_start < self.num_prompt_tokens else []
        # prompt positions whose logits a queued step computes, not recorded yet (overlapped steps)
        self.prompt_logprobs_queued = 0

    @property
    def cache_key(self) -> Hashable:
        """The extra keys its prefix-cache blocks chain from (engine/block_manager.py): the cache
        salt and the adapter, or None for neither (later: a prompt's image hashes)."""
        if self.lora is None:
            return self.params.cache_salt
        return (self.params.cache_salt, self.lora.cache_key)

    def block_key(self, index: int, block_size: int) -> tuple:
        """What a prefix-cache block of this sequence holds: its token ids, and the content of
        any image it holds placeholders of (equal placeholders of two images never match)."""
        start, end = index * block_size, (index + 1) * block_size
        chunk = tuple(self.token_ids[start:end])
        return chunk if self.multimodal is None else chunk + self.multimodal.block_keys(start, end)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def next_prompt_logprob_position(self) -> int | None:
        """The position whose logits give the next prompt logprob neither recorded nor queued
        (they predict the token after it); None when none is missing (or none was asked for)."""
        if self.prompt_logprobs is None:
            return None
        position = self.params.prompt_logprobs_start + len(self.prompt_logprobs) + self.prompt_logprobs_queued - 1
        return position if position < self.num_prompt_tokens - 1 else None

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt logprob asked for is recorded (none missing, none in a queued step)."""
        return self.next_prompt_logprob_position is None and not self.prompt_logprobs_queued

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
