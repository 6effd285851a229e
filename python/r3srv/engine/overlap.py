"""Overlapped scheduling (EngineConfig.async_scheduling): the host schedules and prepares step
N+1 while the device runs step N.

Each call of `step` queues a step on the executor's device thread (`Executor.submit`) and then
books the step queued by the call before, whose tokens are known by then. A sequence that
samples in a queued step gets a placeholder token at once, so the scheduler gives it its next
decode token in the following step; that step's input reads the real token on the device, from
the previous step's sampled ids (a "hole"). Booking a step puts its tokens in place of the
placeholders and then checks stops, exactly as the non-overlapped core does, so tokens and
routed-experts rows do not change:

- a sequence that ended at step N had step N+1 queued for nothing: that step's token and rows
  are dropped (its KV slots were freed when it ended; later steps that reuse them run, and
  store their rows, after it);
- blocks are registered for prefix hits only when booked, once no placeholder is in them;
- a sequence preempted after its sample was queued lost its rows: when it ends, it ends once
  they are recomputed (`Sequence.finish_later`), as a stop string after a preemption does;
- sampling reads what it needs of a sequence when the step is queued (`_Sampler`), so the
  device thread never reads a sequence the host is changing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from r3srv.engine.scheduler import SchedulerOutput
from r3srv.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from r3srv.engine.core import CoreOutputs, EngineCore, _Request, SeqUpdate

PLACEHOLDER = -1  # a token sampled by a queued step, not read back yet


@dataclass(frozen=True, slots=True)
class _Sampler:
    """What sampling reads of a sequence, as it is when its step is queued."""

    params: object
    generator: torch.Generator | None
    num_output_tokens: int
    adjusts_logits: bool  # logit_bias (penalties and prompt logprobs are refused with async scheduling)


@dataclass
class _QueuedStep:
    sched: SchedulerOutput
    future: Future
    sampled: list[tuple[Sequence, int]]  # each sampling sequence and its placeholder's index
    computed_after: list[int]  # per sched.seqs: tokens computed once this step has run
    num_scheduled: dict[int, int]  # seq_id -> the tokens this step computes for it
    row_of: dict[int, int]  # seq_id -> its row in this step's samples


class OverlappedStepper:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.queued: _QueuedStep | None = None
        self.carried: CoreOutputs | None = None  # booked by a drain, handed out by the next step

    @property
    def busy(self) -> bool:
        return self.queued is not None or self.carried is not None

    def rows_stored_upto(self, seq: Sequence) -> int:
        """How many leading tokens of `seq` have their rows stored (not just queued)."""
        if seq.status != SequenceStatus.RUNNING:
            return 0
        queued = self.queued
        return seq.num_computed_tokens - (queued.num_scheduled.get(seq.seq_id, 0) if queued is not None else 0)

    def step(self) -> CoreOutputs:
        from r3srv.engine.core import CoreOutputs

        result, self.carried = self.carried or CoreOutputs(), None
        sched = self.core.scheduler.schedule()
        queued = self._queue(sched, result) if sched.seqs else None
        if self.queued is not None:
            self._book(self.queued, result)
        self.queued = queued
        return result

    def drain(self) -> None:
        from r3srv.engine.core import CoreOutputs

        if self.queued is None:
            return
        step, self.queued = self.queued, None
        self.carried = self.carried or CoreOutputs()
        self._book(step, self.carried)

    # -- queueing ---------------------------------------------------------------------------
    def _queue(self, sched: SchedulerOutput, result: CoreOutputs) -> _QueuedStep:
        from r3srv.engine.core import _count_tokens

        core = self.core
        _count_tokens(sched, result)
        seqs = sched.seqs
        prev_rows = self.queued.row_of if self.queued is not None else {}
        holes: list[tuple[int, int]] = []
        offset = 0
        for s in seqs:
            last = s.num_tokens - 1
            if s.token_ids[last] == PLACEHOLDER and s.num_computed_tokens <= last < s.num_computed_tokens + s.num_scheduled_tokens:
                holes.append((offset + last - s.num_computed_tokens, prev_rows[s.seq_id]))
            offset += s.num_scheduled_tokens
        picked = [seqs[i] for i in sched.sample_indices]
        samplers = [_Sampler(s.params, s.generator, s.num_output_tokens, s.adjusts_logits) for s in picked]
        future = core.executor.submit(sched, samplers, holes)
        num_scheduled = {s.seq_id: s.num_scheduled_tokens for s in seqs}
        core.scheduler.advance(sched)
        sampled = []
        for s in picked:
            s.token_ids.append(PLACEHOLDER)
            sampled.append((s, s.num_tokens - 1))
        return _QueuedStep(sched, future, sampled, [s.num_computed_tokens for s in seqs], num_scheduled,
                           {s.seq_id: row for row, s in enumerate(picked)})

    # -- booking ----------------------------------------------------------------------------
    def _book(self, step: _QueuedStep, result: CoreOutputs) -> None:
        """The non-overlapped core's bookkeeping of one step, once its tokens are known."""
        core = self.core
        seqs = step.sched.seqs
        try:
            out = step.future.result()
        except Exception as exc:  # fail this step's requests, keep the engine alive
            for rid in dict.fromkeys(s.request_id for s in seqs):
                core._fail(rid, exc, result)
            return
        if core.rows is not None:
            core.rows.store(out.slot_mapping, out.routing_capture)
        touched: dict[str, tuple[_Request, list[SeqUpdate]]] = {}
        sampled = step.sampled
        if out.sample_error is not None:
            for rid in dict.fromkeys(s.request_id for s, _ in sampled):
                core._fail(rid, out.sample_error, result)
            sampled = []
        for (seq, pos), res in zip(sampled, out.samples):
            req = core.requests.get(seq.request_id)
            if req is None or seq.is_finished or pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
                continue  # ended meanwhile (a stop, an abort, a stop string's cut): a step queued for nothing
            update = self._sampled(req, seq, pos, res)
            if update is not None:
                touched.setdefault(seq.request_id, (req, []))[1].append(update)
        for seq, after in zip(seqs, step.computed_after):
            if seq.status != SequenceStatus.RUNNING:
                continue  # ended, or preempted since this step was queued
            core.block_manager.commit_full_blocks(seq)
            if seq.finish_later is not None and after >= seq.num_tokens - 1:
                req = core.requests[seq.request_id]  # its kept tokens' rows are stored: finish it
                touched.setdefault(seq.request_id, (req, []))[1].append(core._finish(seq, *seq.finish_later))
        for req, updates in touched.values():
            result.updates.append(core._update(req, updates))
            if any(u.finish_reason is not None for u in updates):
                core._forget_if_finished(req)

    def _sampled(self, req: _Request, seq: Sequence, pos: int, res) -> SeqUpdate | None:
        """The token `res` in place of the placeholder at `pos`, and the stop checks; None while
        its end waits for recomputed rows (the update then comes with the end)."""
        from r3srv.engine.core import SeqUpdate

        core = self.core
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.deferred and seq.index == 0:
            for sib in req.deferred:
                core.scheduler.add(sib)
            req.deferred = []
        seq.token_ids[pos] = res.token_id
        tail = seq.token_ids[pos + 1 :]  # the next step's placeholder, if one is queued
        del seq.token_ids[pos + 1 :]
        end = core.end_of(seq, res.token_id)
        if end is None:
            seq.token_ids += tail
            return SeqUpdate(seq.index, res)
        if seq.status != SequenceStatus.RUNNING and req.prepared.return_routed_experts and core.rows is not None:
            seq.finish_later = (*end, res)  # preempted since: its rows come back before it ends
            return None
        return core._finish(seq, *end, res)
