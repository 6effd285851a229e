"""The engine core's steps: schedule, hand the step to the executor, book what it computed.

One bookkeeping for both ways of stepping:

- plain: each `step()` runs the step it schedules in this thread and books it at once;
- overlapped (EngineConfig.async_scheduling): each `step()` queues its step on the executor's
  device thread (`Executor.submit`) and then books the step queued by the call before, whose
  tokens are known by then; the host prepares step N+1 while the device runs step N.

Either way a step is queued the same way: its prompt-logprob positions are reserved on their
sequences, its tokens are counted as computed, and every sequence that samples gets a
placeholder token. An overlapped step samples on the device thread from what it read of the
sequences when it was queued (`SampleView`: that thread never reads a sequence the host is
changing); a plain one samples here, from the sequences. In an overlapped step the next step of such a sequence
computes the placeholder's position: its input id is filled on the device from the previous
step's samples (a "hole"), and so is its last output id where penalties read it. Booking puts
the sampled token in place of the placeholder, registers the full blocks (never with a
placeholder in them), then runs the stop checks, as the plain step always did, so tokens and
routed-experts rows do not depend on the way of stepping. What overlapping adds is only what
happens to work queued for nothing:

- a sequence that ended at step N had step N+1 queued too: that step's token and rows are
  dropped (its KV slots were freed when it ended; later steps that reuse them run, and store
  their rows, after it);
- a sequence preempted after its sample was queued lost its rows: when it ends, it ends once
  they are recomputed (`Sequence.finish_later`), as a stop string after a preemption does.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from r3srv.engine.executor import StepInputs
from r3srv.engine.requests import CoreOutputs, CoreRequest, SeqUpdate
from r3srv.engine.sampler import SampleView, prompt_logprobs
from r3srv.engine.scheduler import SchedulerOutput
from r3srv.engine.sequence import Sequence, SequenceStatus
from r3srv.errors import InvalidRequestError

if TYPE_CHECKING:
    from r3srv.config import EngineConfig
    from r3srv.engine.core import EngineCore

PLACEHOLDER = -1  # a token sampled by a queued step, not read back yet


class Ran:
    """A step run in this thread (plain stepping): its ModelOutput or its error, read as a Future's."""

    __slots__ = ("value", "error")

    def __init__(self, execute, inputs: StepInputs) -> None:
        self.value, self.error = None, None
        try:
            self.value = execute(inputs)
        except Exception as exc:
            self.error = exc

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class QueuedStep:
    sched: SchedulerOutput
    future: Future | Ran
    sampled: list[tuple[Sequence, int, Any]]  # each sampling sequence, its placeholder's index, what sampling read
    computed_after: list[int]  # per sched.seqs: tokens computed once this step has run
    num_scheduled: dict[int, int]  # seq_id -> the tokens this step computes for it
    row_of: dict[int, int]  # seq_id -> its row in this step's samples
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # the weights the step runs on: an update drains queued steps before it loads
    weight_version: str | None = None


class Stepper:
    """The core's steps, plain or overlapped (see the module docstring)."""

    def __init__(self, core: EngineCore, overlapped: bool) -> None:
        self.core = core
        self.overlapped = overlapped
        self.queued: QueuedStep | None = None  # overlapped: the step on the device, not booked yet
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
        result, self.carried = self.carried or CoreOutputs(), None
        sched = self.core.scheduler.schedule()
        queued = self._queue(sched, result) if sched.seqs else None
        if not self.overlapped:
            if queued is not None:
                self._book(queued, result)
            return result
        if self.queued is not None:
            self._book(self.queued, result)
        self.queued = queued
        return result

    def drain(self) -> None:
        """Wait for the step in flight and book it (its outputs come with the next step), so a
        control call finds the device idle and no token unknown."""
        if self.queued is None:
            return
        step, self.queued = self.queued, None
        self.carried = self.carried or CoreOutputs()
        self._book(step, self.carried)

    # -- queueing ---------------------------------------------------------------------------
    def _queue(self, sched: SchedulerOutput, result: CoreOutputs) -> QueuedStep:
        core = self.core
        count_tokens(sched, result)
        seqs = sched.seqs
        if core.lora is not None:  # the step's adapters resident, each sequence told its slot
            in_flight = self.queued if self.overlapped else None
            if in_flight is None:
                core.lora.assign(seqs)
            else:  # the step on the device keeps its adapters' slots until it is done
                core.lora.assign(seqs, in_flight.sched.seqs, lambda: wait_futures([in_flight.future]))
        if core.num_state_snapshots:  # a hybrid with prefix caching: where this step copies states
            for s in seqs:
                core.block_manager.plan_snapshots(s)
        picked = [seqs[i] for i in sched.sample_indices]
        spans = reserve_prompt_logprobs(seqs)
        if self.overlapped:
            prev_rows = self.queued.row_of if self.queued is not None else {}
            samplers = [SampleView.of(s, prev_rows.get(s.seq_id) if s.token_ids[-1] == PLACEHOLDER else None)
                        for s in picked]
            future = core.executor.submit(StepInputs(sched, samplers, spans, holes(seqs, prev_rows)))
            num_scheduled = {s.seq_id: s.num_scheduled_tokens for s in seqs}
            row_of = {s.seq_id: row for row, s in enumerate(picked)}
        else:  # no placeholder is left in a sequence: sampling reads the sequences themselves, here
            samplers = picked
            future = Ran(core.executor.execute, StepInputs(sched, samplers, spans))
            num_scheduled = row_of = {}
        core.scheduler.advance(sched)
        sampled = []
        for s, sampler in zip(picked, samplers):
            s.token_ids.append(PLACEHOLDER)
            sampled.append((s, s.num_tokens - 1, sampler))
        return QueuedStep(sched, future, sampled, [s.num_computed_tokens for s in seqs], num_scheduled, row_of, spans,
                          core.weight_version)

    # -- booking ----------------------------------------------------------------------------
    def _book(self, step: QueuedStep, result: CoreOutputs) -> None:
        """What one step computed, once its tokens are known: rows, prompt logprobs, tokens,
        registered blocks, stop checks and updates."""
        core = self.core
        seqs = step.sched.seqs
        try:
            out = step.future.result()
        except Exception as exc:  # fail this step's requests, keep the engine alive
            for rid in dict.fromkeys(s.request_id for s in seqs):
                core.fail_request(rid, exc, result)
            return
        if core.rows is not None:
            core.rows.store(out.slot_mapping, out.routing_capture)
            if out.routing_weights is not None:
                core.rows.store_weights(out.slot_mapping, out.routing_weights)
        if out.indexer_topk is not None:
            core.indexer_topk.store(out.slot_mapping, out.indexer_topk)
        self._record_prompt_logprobs(seqs, out, step.prompt_spans, result)
        sampled = step.sampled
        if out.sample_error is not None:
            for rid in dict.fromkeys(s.request_id for s, _, _ in sampled):
                core.fail_request(rid, out.sample_error, result)
            sampled = []
        placed = []
        for (seq, pos, sampler), res in zip(sampled, out.samples):
            req = core.requests.get(seq.request_id)
            if req is None or seq.is_finished or pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
                continue  # ended meanwhile (a stop, an abort, a failure, a stop string's cut): queued for nothing
            if res.mask_ids is not None and len(res.mask_ids) > core.config.sampling_mask_max_tokens:
                core.fail_request(seq.request_id, _mask_overflow(len(res.mask_ids), core.config), result)
                continue
            seq.token_ids[pos] = res.token_id
            res.weight_version = step.weight_version
            if seq.prompt_token_mask is None:  # computed while sampling a view, kept for the next steps
                seq.prompt_token_mask = sampler.prompt_token_mask
            placed.append((req, seq, pos, res))
        for seq in seqs:
            if seq.status == SequenceStatus.RUNNING:  # not ended, nor preempted since this step was queued
                core.block_manager.commit_full_blocks(seq)
        touched: dict[str, tuple[CoreRequest, list[SeqUpdate]]] = {}
        for req, seq, pos, res in placed:
            update = self._sampled(req, seq, pos, res)
            if update is not None:
                touched.setdefault(seq.request_id, (req, []))[1].append(update)
        for seq, after in zip(seqs, step.computed_after):
            if seq.status == SequenceStatus.RUNNING and seq.finish_later is not None and after >= seq.num_tokens - 1:
                req = core.requests[seq.request_id]  # its kept tokens' rows are stored: finish it
                touched.setdefault(seq.request_id, (req, []))[1].append(core.finish_sequence(seq, *seq.finish_later))
        for req, updates in touched.values():
            result.updates.append(core.request_update(req, updates))
            if any(u.finish_reason is not None for u in updates):
                core.forget_if_finished(req)

    def _record_prompt_logprobs(self, seqs: list[Sequence], out, spans: list[tuple[int, int, int]],
                                result: CoreOutputs) -> None:
        """Append the step's prompt logprobs to their sequences (those still in flight); a failure
        fails the requests that asked for them, the others go on."""
        if not spans:
            return
        for i, _, count in spans:
            seqs[i].prompt_logprobs_queued -= count
        live = [(i, position, count) for i, position, count in spans if self.core.requests.get(seqs[i].request_id)]
        if out.prompt_logits is None or not live:
            return
        try:
            record_prompt_logprobs(seqs, out.prompt_logits, spans, live, self.core.config.logprobs_mode)
        except Exception as exc:
            for i, _, _ in live:
                self.core.fail_request(seqs[i].request_id, exc, result)

    def _sampled(self, req: CoreRequest, seq: Sequence, pos: int, res) -> SeqUpdate | None:
        """The stop checks of the token `res`, now at `pos`; None while its end waits for
        recomputed rows (the update then comes with the end)."""
        core = self.core
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.deferred and seq.index == 0:
            for sib in req.deferred:
                core.scheduler.add(sib)
            req.deferred = []
        tail = None
        if pos + 1 < len(seq.token_ids):  # the next step's placeholder, queued: not part of the checks
            tail = seq.token_ids[pos + 1 :]
            del seq.token_ids[pos + 1 :]
        end = core.end_of(seq, res.token_id)
        if end is None:
            if tail:
                seq.token_ids += tail
            return SeqUpdate(seq.index, res)
        if seq.status != SequenceStatus.RUNNING and req.prepared.return_routed_experts and core.rows is not None:
            seq.finish_later = (*end, res)  # preempted since: its rows come back before it ends
            return None
        return core.finish_sequence(seq, *end, res)


def holes(seqs: list[Sequence], prev_rows: dict[int, int]) -> list[tuple[int, int]]:
    """(position in the step's input ids, row in the previous step's samples) of every
    placeholder this step computes."""
    found: list[tuple[int, int]] = []
    offset = 0
    for s in seqs:
        last = s.num_tokens - 1
        if s.token_ids[last] == PLACEHOLDER and s.num_computed_tokens <= last < s.num_computed_tokens + s.num_scheduled_tokens:
            found.append((offset + last - s.num_computed_tokens, prev_rows[s.seq_id]))
        offset += s.num_scheduled_tokens
    return found


def count_tokens(sched: SchedulerOutput, result: CoreOutputs) -> None:
    """The step's decode tokens (one for a sequence at its last token) and prefill tokens."""
    for s in sched.seqs:
        if s.num_tokens - s.num_computed_tokens == s.num_scheduled_tokens and s.num_scheduled_tokens == 1:
            result.num_decode_tokens += 1
        else:
            result.num_prefill_tokens += s.num_scheduled_tokens


def reserve_prompt_logprobs(seqs: list[Sequence]) -> list[tuple[int, int, int]]:
    """(sequence index, first position, count): the positions of this step whose logits give
    the prompt logprobs a sequence still misses (each predicts the token after it), reserved on
    the sequence until the step is booked."""
    spans = []
    for i, seq in enumerate(seqs):
        if seq.prompt_logprobs is None:  # most sequences: none asked for
            continue
        position = seq.next_prompt_logprob_position
        if position is None:
            continue
        start = seq.num_computed_tokens
        end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        # position < start would mean positions served by the prefix cache: such sequences skip it
        if start <= position < end:
            spans.append((i, position, end - position))
            seq.prompt_logprobs_queued += end - position
    return spans


def record_prompt_logprobs(seqs: list[Sequence], logits, spans: list[tuple[int, int, int]],
                           live: list[tuple[int, int, int]], logprobs_mode: str = "raw_logprobs") -> None:
    """Append the prompt logprobs of the `live` spans (a subset of `spans`, whose runs of rows
    `logits` [R, vocab] holds in order) to their sequences, as `logprobs_mode` says."""
    first, rows = 0, {}
    for span in spans:
        rows[span] = first
        first += span[2]
    index = [rows[span] + j for span in live for j in range(span[2])]
    chosen = logits if len(index) == logits.shape[0] else logits[index]
    targets = [t for i, position, count in live for t in seqs[i].token_ids[position + 1 : position + 1 + count]]
    num_top = [seqs[i].params.prompt_logprobs for i, _, count in live for _ in range(count)]
    entries = prompt_logprobs(chosen, targets, num_top, logprobs_mode)
    first = 0
    for i, _, count in live:
        seqs[i].prompt_logprobs.extend(entries[first : first + count])
        first += count


def _mask_overflow(size: int, config: EngineConfig) -> InvalidRequestError:
    """The 400 of a sampling mask wider than the server's cap (SGLang's rule and advice)."""
    return InvalidRequestError(
        f"the sampling support of a token holds {size} ids, more than --sampling-mask-max-tokens="
        f"{config.sampling_mask_max_tokens}; lower top_k (or top_p) or raise the server's limit",
        param="sampling_mask_max_tokens")
