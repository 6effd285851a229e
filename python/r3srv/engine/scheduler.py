"""Continuous batching: which sequences compute how many tokens this step.

Each step mixes decode tokens of running sequences with (possibly chunked) prefills of
waiting ones, under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running sequences go first, oldest first; when the pool cannot give
one its next block, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed later
(prefix-cache hits make that cheap, and rows come back identical either way).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from r3srv.engine.block_manager import BlockManager
from r3srv.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)  # each with num_scheduled_tokens > 0
    num_preempted: int = 0
    # positions in `seqs` of those whose step ends at their last token, so they sample one more
    # (a sequence stopped by a stop string only recomputes its rows: it samples nothing)
    sample_indices: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 0, encoder_budget: int = 0, encoded: Callable[[str], bool] | None = None) -> None:
        self.block_manager = block_manager
        self.max_loras = max_loras  # distinct adapters among the running sequences (vLLM's --max-loras)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # image prompts: the vision tower's tokens per step, and whether an image's outputs are
        # cached already (engine/encoder_cache.py: those cost nothing)
        self.encoder_budget = encoder_budget
        self.encoded = encoded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _within_encoder_budget(self, seq: Sequence, start: int, n: int, step: dict) -> int:
        """How many of the n tokens from `start` this step may compute so that the images it
        starts encoding (not cached, not already this step's) stay within the encoder budget:
        the chunk stops before the first image that would pass it, unless that image is the
        step's first (an image larger than the budget runs alone)."""
        if seq.multimodal is None or self.encoded is None:
            return n
        for image, lo, _ in seq.multimodal.overlaps(start, start + n):
            key = image.content_hash
            if key in step or image.embeds is not None or self.encoded(key):  # given embeddings: no tower work
                continue
            cost = image.num_tokens(seq.multimodal.merge)
            if step and sum(step.values()) + cost > self.encoder_budget:
                return image.span.start + lo - start
            step[key] = cost
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        encoding: dict[str, int] = {}  # images this step encodes: tokens by content hash

        # 1. Running sequences: one decode token each, or the next chunk of a prefill.
        queue = deque(self.running)
        kept: list[Sequence] = []
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0:
                n = self._within_encoder_budget(seq, seq.num_computed_tokens, n, encoding)
            if n <= 0:  # overlapped scheduling: computed ahead of a stop string's cut, finishing
                kept.append(seq)  # (or an image over this step's encoder budget: the next step)
                continue
            target = seq.num_computed_tokens + n
            while not bm.can_grow(seq, target):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.grow(seq, target)
                seq.num_scheduled_tokens = n
                budget -= n
                out.seqs.append(seq)
                kept.append(seq)
        self.running = kept + list(queue)  # `queue` holds those left out by the budget

        # 2. Waiting sequences, unless this step had to preempt (the pool is tight). One whose
        # adapter would be one too many for the slots waits, in order, for a later step.
        adapters = {s.lora.name for s in self.running if s.lora is not None}
        held: list[Sequence] = []
        while self.waiting and out.num_preempted == 0 and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and seq.lora.name not in adapters and len(adapters) >= self.max_loras:
                held.append(self.waiting.popleft())
                continue
            cached = bm.match_sequence(seq)
            start = len(cached) * bm.block_size
            n = self._within_encoder_budget(seq, start, min(seq.num_tokens - start, budget), encoding)
            if n <= 0 or bm.admission_cost(seq, cached, start + n) > bm.num_free_blocks:
                break
            self.waiting.popleft()
            bm.admit(seq, cached)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = start
            bm.grow(seq, start + n)
            seq.num_scheduled_tokens = n
            seq.status = SequenceStatus.RUNNING
            budget -= n
            out.seqs.append(seq)
            self.running.append(seq)
            if seq.lora is not None:
                adapters.add(seq.lora.name)
        self.waiting.extendleft(reversed(held))
        out.sample_indices = [
            i for i, s in enumerate(out.seqs)
            if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens and s.finish_later is None
        ]
        return out

    def mark_computed(self, out: SchedulerOutput) -> None:
        """After the step of `out` ran: its scheduled tokens are computed, and full blocks are
        registered for prefix hits. (The sequences at `out.sample_indices` now sample.)"""
        self.advance(out)
        for seq in out.seqs:
            self.block_manager.commit_full_blocks(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """Count the scheduled tokens of `out` as computed (overlapped scheduling: as soon as the
        step is queued; its blocks are registered once its sampled tokens are known)."""
        for seq in out.seqs:
            if seq.is_finished:  # failed in this step (its blocks are freed)
                continue
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._back_to_waiting(seq)
        seq.num_preempted += 1
        self.num_preemptions += 1

    def retract_running(self) -> int:
        """Every running sequence back to the front of the waiting queue, oldest first, its
        blocks freed: it is recomputed when scheduled again (a pause before a weight update,
        not a preemption). Returns how many."""
        running, self.running = self.running, []
        for seq in reversed(running):
            self._back_to_waiting(seq)
        return len(running)

    def _back_to_waiting(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (its cached blocks stay reusable)."""
        self.block_manager.free(seq)
        seq.num_scheduled_tokens = 0
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
