"""The synchronous engine core: requests in, one step at a time, cumulative outputs out.

Not thread-safe: the offline `LLM` calls it from its own thread and `AsyncLLM` from its
one background thread. `prepare_request` is the exception: it only reads the tokenizer
and configs, so the async front validates on the caller's thread before queuing.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from r3srv.config import EngineConfig, ParallelConfig
from r3srv.engine import cuda_graphs
from r3srv.engine.block_manager import BlockManager
from r3srv.engine.detokenizer import IncrementalDetokenizer
from r3srv.engine.model_runner import ModelRunner
from r3srv.engine.routed_experts import RoutedExpertsBuffer, capture_torch_dtype
from r3srv.engine.sampler import prompt_logprobs, sample
from r3srv.engine.scheduler import Scheduler
from r3srv.engine.sequence import Sequence
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.outputs import CompletionOutput, OutputKind, RequestOutput
from r3srv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from r3srv.models.loader import NamedTensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default share of free memory for the KV cache when num_kv_blocks is not given.
_DEFAULT_KV_FRACTION = {"cpu": 0.25, "cuda": 0.85}
_CPU_KV_CAP_BYTES = 8 << 30
log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which served from it
    num_preemptions: int
    released_memory: tuple[str, ...] = ()  # MEMORY_TAGS given back by release_memory
    state_slots_total: int = 0  # linear-attention state slots (hybrid models; else 0)
    state_slots_used: int = 0
    paused: str | None = None  # AsyncLLM.pause_generation's mode while paused


@dataclass
class PreparedRequest:
    """A validated request, ready to be added (built off the engine thread)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    return_routed_experts: bool
    # FINAL_ONLY for a consumer that waits for the end (non-streaming HTTP, offline generate):
    # no per-step outputs. DELTA for a streaming one: per-step outputs cost the new tokens only,
    # where CUMULATIVE ones copy every token and logprob so far, every step.
    output_kind: OutputKind = OutputKind.CUMULATIVE


@dataclass
class Request:
    prepared: PreparedRequest
    seqs: list[Sequence]
    deferred: list[Sequence] = field(default_factory=list)  # n > 1 samples waiting for sample 0's prompt
    weight_version: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class StepResult:
    # requests that changed this step (only the finished ones for FINAL_ONLY requests)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request_id, error)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


MEMORY_TAGS = ("kv_cache", "weights")  # SGLang's release/resume_memory_occupation tags


def _memory_tags(tags: list[str] | None) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise InvalidRequestError(f"unknown memory tags {unknown}; expected any of {list(MEMORY_TAGS)}", param="tags")
    return set(tags)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from r3srv.models.loader import load_model

        self.config = config
        self.device = torch.device(config.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.executor = _multiproc_executor(config)  # None at tensor_parallel_size 1
        if self.executor is None:
            self.model, self.tokenizer = load_model(config.model, device=config.device, dtype=dtype)
        else:  # the ranks' shards, driven as one model
            self.model, self.tokenizer = self.executor, self.executor.tokenizer
        self.model_config = self.model.config
        config.finalize(self.model_config)
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.enable_return_routed_experts = config.enable_return_routed_experts

        # a hybrid's linear-attention states: a slot per running sequence, and with prefix
        # caching as many snapshots again for the running ones plus as many kept for later hits
        self.num_state_slots = config.max_num_seqs if self.model_config.is_hybrid else 0
        self.num_state_snapshots = 2 * self.num_state_slots if config.enable_prefix_caching else 0
        mc = self.model_config
        capture_dtype = capture_torch_dtype(mc.num_experts) if config.enable_return_routed_experts else None
        blocker = "not asked for"
        if config.use_cuda_graphs:
            blocker = "not under tensor parallelism yet" if self.executor else cuda_graphs.graph_blocker(self.model)
        if config.use_cuda_graphs and blocker:
            log.warning("CUDA graphs off: %s", blocker)
        graphs = None if blocker else cuda_graphs.DecodeGraphs(
            self.model, config.block_size, config.max_num_seqs, self.max_model_len, self.num_state_snapshots,
            capture_dtype)
        self.graphs_reserved = 0 if graphs is None else graphs.reserve()  # out of the KV budget
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        config.check_kv_pool(num_blocks)
        config.num_kv_blocks = num_blocks
        if graphs is None:
            self.model.init_kv_cache(num_blocks, config.block_size, config.max_num_seqs, self.num_state_snapshots)
        else:
            graphs.init_kv_cache(num_blocks)  # and the padding rows' scratch block and state entry
        self._log_memory_plan(num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            num_state_slots=self.num_state_slots, num_state_snapshots=self.num_state_snapshots,
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.rows = (
            RoutedExpertsBuffer(num_blocks * config.block_size, mc.num_layers, mc.top_k, mc.num_experts)
            if config.enable_return_routed_experts
            else None
        )
        self.runner = ModelRunner(self.model, config.block_size, self.device, self.rows, graphs)
        eos = list(mc.eos_token_ids or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids = eos
        # Noise for requests without a seed: one generator, so their rows sample in one batched draw.
        self._sampling_generator = torch.Generator(device=self.device)
        self._sampling_generator.manual_seed(config.seed)
        self.weight_version = config.weight_version
        self.model_path = config.model  # the checkpoint the weights came from (None: the built-in model)
        self.requests: dict[str, Request] = {}
        self.released_memory: set[str] = set()  # MEMORY_TAGS given back by release_memory

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        """EngineConfig's and ParallelConfig's fields as keywords."""
        return cls(engine_config(model, **kwargs))

    # -- sizing -------------------------------------------------------------------------
    def _log_memory_plan(self, num_blocks: int) -> None:
        """What each rank holds (rank 0's shard stands for all: the splits are even)."""
        shard = self.model if self.executor is None else self.executor.model
        weights = sum(p.numel() * p.element_size() for p in shard.parameters())
        kv = num_blocks * self.model.kv_cache_bytes_per_block(self.config.block_size)
        states = (self.num_state_slots + self.num_state_snapshots) * self.model.state_bytes_per_slot()
        ranks = self.config.parallel.tensor_parallel_size
        log.info("memory per rank (%d rank%s): weights %.3f GiB, KV cache %.3f GiB (%d blocks of %d tokens)%s",
                    ranks, "s" if ranks > 1 else "", weights / 2**30, kv / 2**30, num_blocks, self.config.block_size,
                    f", linear-attention states {states / 2**30:.3f} GiB" if states else "")

    def _auto_num_blocks(self) -> int:
        cfg = self.config
        per_block = self.model.kv_cache_bytes_per_block(cfg.block_size)
        mc = self.model_config
        if cfg.enable_return_routed_experts:
            per_block += cfg.block_size * mc.num_layers * mc.top_k * (1 if mc.num_experts <= 256 else 4)
        kind = self.device.type
        fraction = cfg.kv_cache_memory_fraction or _DEFAULT_KV_FRACTION[kind]
        if kind == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * fraction)
        else:
            budget = min(int(_mem_available() * fraction), _CPU_KV_CAP_BYTES)
        budget -= self.graphs_reserved
        # a hybrid's linear-attention states
        states = (self.num_state_slots + self.num_state_snapshots) * self.model.state_bytes_per_slot()
        if states and states >= budget:
            raise ConfigError(
                f"the linear-attention states of max_num_seqs={cfg.max_num_seqs} sequences (and with prefix "
                f"caching their snapshots) take {states / 2**30:.2f} GiB, more than the {budget / 2**30:.2f} GiB "
                "cache budget; lower max_num_seqs, disable prefix caching or raise kv_cache_memory_fraction"
            )
        budget -= states
        # More than every sequence at full length is never used.
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return max(1, min(budget // max(per_block, 1), useful))

    # -- requests -----------------------------------------------------------------------
    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        *,
        add_special_tokens: bool = True,
    ) -> PreparedRequest:
        """Validate and tokenize; every problem is an InvalidRequestError raised here, before scheduling.

        add_special_tokens=False for a rendered chat template: it already holds the BOS
        and other specials, and the tokenizer's post-processor would add a second BOS.
        """
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer (no tokenizer.json): send the prompt as token ids", param="prompt"
                )
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            text = None
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError(param="prompt", problem=" must be a string or a list of token ids") from None
        ids = self._truncated(ids, params)
        if not ids:
            raise InvalidRequestError(param="prompt", problem=" is empty (it has no tokens)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(param="prompt", problem=f" holds token id {bad}, outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(param="stop_token_ids", problem=f" holds {bad}, outside the vocabulary [0, {vocab})")
        self._check_sampling_limits(params)
        n_prompt = len(ids)
        if params.prompt_logprobs_start > n_prompt:
            raise InvalidRequestError(
                param="prompt_logprobs_start",
                problem=f"={params.prompt_logprobs_start} is beyond the prompt's {n_prompt} tokens",
            )
        start = params.routed_experts_prompt_start
        if not 0 <= start <= n_prompt:
            raise InvalidRequestError(
                param="routed_experts_prompt_start",
                problem=f"={start} is outside 0..{n_prompt} (the prompt has {n_prompt} tokens)",
            )
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                param="prompt",
                problem=f" has {n_prompt} tokens, leaving no room to generate within max_model_len={self.max_model_len}",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                param="max_tokens",
                problem=f"={max_tokens} plus the prompt's {n_prompt} tokens exceeds max_model_len="
                f"{self.max_model_len}; ask for at most {self.max_model_len - n_prompt} tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                param="min_tokens", problem=f"={params.min_tokens} exceeds the {max_tokens} tokens this request may generate"
            )
        want = params.return_routed_experts
        if want and not self.enable_return_routed_experts:
            raise InvalidRequestError(
                "return_routed_experts=true, but this engine was started without routed-experts capture; "
                "start it with --enable-return-routed-experts (enable_return_routed_experts=True)",
                param="return_routed_experts",
            )
        if want is None:
            want = self.enable_return_routed_experts
        return PreparedRequest(str(request_id), text, ids, params, max_tokens, bool(want))

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt after truncate_prompt_tokens, checked in vLLM's order: a size above
        max_model_len is refused before truncating; -1 keeps max_model_len - 1 tokens."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self.max_model_len:
            raise InvalidRequestError(
                param="truncate_prompt_tokens",
                problem=f"={keep} cannot be greater than max_model_len={self.max_model_len}; "
                "request a smaller truncation size",
            )
        if keep == -1:
            keep = self.max_model_len - 1
        if keep >= len(ids):
            return ids
        return ids[len(ids) - keep :] if params.truncation_side == "left" else ids[:keep]

    def _check_sampling_limits(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logit_bias ids against the vocabulary, and logprob
        counts against max_logprobs (-1, the whole vocabulary, counts as vocab_size), as vLLM."""
        vocab = self.model_config.vocab_size
        bad = sorted(t for t in (params.logit_bias or ()) if not 0 <= t < vocab)
        if bad:
            raise InvalidRequestError(param="logit_bias", problem=f" holds token ids {bad}, outside the vocabulary [0, {vocab})")
        limit = self.config.max_logprobs
        limit = vocab if limit == -1 else limit
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            asked = vocab if asked == -1 else asked
            if asked is not None and asked > limit:
                raise InvalidRequestError(
                    param=name,
                    problem=f": requested {asked}, which is greater than max allowed: {limit} "
                    "(the server's --max-logprobs; -1 asks for the whole vocabulary)",
                )

    def add_prepared(self, prep: PreparedRequest) -> None:
        if self.released_memory:
            raise InvalidRequestError(
                f"the engine's {' and '.join(sorted(self.released_memory))} memory is released: resume it first"
            )
        if prep.request_id in self.requests:
            raise InvalidRequestError(f"request_id {prep.request_id!r} is already in flight", param="request_id")
        p = prep.params
        seqs = [Sequence(prep.request_id, i, prep.prompt_token_ids, p, prep.max_tokens, self._generator(p, i)) for i in range(p.n)]
        for seq in seqs:
            seq.detok = IncrementalDetokenizer(self.tokenizer, prep.prompt_token_ids, p.skip_special_tokens)
        req = Request(prep, seqs, weight_version=self.weight_version)
        self.requests[prep.request_id] = req
        self.scheduler.add(seqs[0])
        # With prefix caching, samples 1..n-1 wait until sample 0 has computed the prompt,
        # then share its full blocks instead of recomputing them.
        if self.config.enable_prefix_caching:
            req.deferred = seqs[1:]
        else:
            for seq in seqs[1:]:
                self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, params))

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """A seeded request's own generator (its samples then depend on its seed alone)."""
        if params.greedy or params.seed is None:
            return None
        # n > 1: sample i of a seeded request uses seed + i (as vLLM's parallel sampling does).
        gen = torch.Generator(device=self.device)
        gen.manual_seed((params.seed + index) % (1 << 63))
        return gen

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._stop_unfinished(req, "abort")
        return self._output(req)

    def retract_running(self) -> int:
        """Send every running sequence back to the waiting queue with its blocks freed: its KV,
        state slot and routed-experts rows are recomputed when it runs again, on the weights
        loaded by then (a partial rollout resumed on a new policy). Returns how many."""
        return self.scheduler.retract_running()

    def _requests_holding_kv(self) -> int:
        return len({seq.request_id for seq in self.scheduler.running})

    def update_weights(self, path: str | NamedTensors, weight_version: str | None = None) -> None:
        """Load new weights of the same architecture (an RL policy update) and forget the prefix cache.
        `path` is a checkpoint directory, or tensors a trainer sent by name (received in full).

        Only while no sequence holds KV: KV and routed-experts rows computed with the old weights
        must not mix with new ones in one sequence, so running requests are an error (let them
        finish, abort them, or retract them first; AsyncLLM.update_weights waits for them).
        Requests that hold none (waiting, or retracted) compute everything on the new weights,
        and their outputs carry its version. A ConfigError leaves the weights as they were.
        `weight_version` names the new weights in every later output (default: `path`).
        """
        from r3srv.models.loader import NamedTensors, load_named_tensors, load_weights_from_dir

        if isinstance(path, NamedTensors):
            load, label = load_named_tensors, "tensors"
        else:
            load, label = load_weights_from_dir, str(path)

        if holding := self._requests_holding_kv():
            raise InvalidRequestError(
                f"cannot update weights with {holding} requests in flight holding KV of the current weights: "
                "let them finish, abort them, or retract them (pause_generation mode=retract)",
                param="model_path",
            )
        if self.executor is not None and isinstance(path, NamedTensors):
            raise InvalidRequestError("weights sent as tensors are not supported under tensor parallelism yet: "
                                      "update from a checkpoint directory", param="model_path")
        # Released weights live in host memory: an update fills them there, and they move
        # back with resume_memory.
        try:
            if self.executor is None:
                load(self.model, path)
            else:
                self.executor.load_weights(path)
        except ConfigError:
            raise  # found before any weight was copied: nothing changed
        except Exception:
            # Failed while copying (an I/O error mid-shard): some weights are new, some old.
            # Say so in every later output rather than serve a silent mix under the old name.
            self.block_manager.reset_prefix_cache()
            self.weight_version = f"incomplete:{label}"
            raise
        self.block_manager.reset_prefix_cache()
        self.weight_version = label if weight_version is None else weight_version
        self.model_path = None if isinstance(path, NamedTensors) else str(path)  # pushed tensors have no checkpoint
        for req in self.requests.values():  # none holds KV: every token of theirs is computed anew
            req.weight_version = self.weight_version

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten."""
        return self.block_manager.reset_prefix_cache()

    def release_memory(self, tags: list[str] | None = None) -> list[str]:
        """Give memory back between rollout batches (a trainer colocated on the same GPU
        trains meanwhile): "kv_cache" frees the KV cache (and forgets the prefix cache),
        "weights" moves the weights to pinned host memory. None: both. Only between
        requests; releasing something already released does nothing. Returns what is released."""
        wanted = _memory_tags(tags)
        if self.requests:  # even retracted ones: nothing may wait to run in released memory
            raise InvalidRequestError(
                f"cannot release memory with {len(self.requests)} requests in flight: let them finish or abort them",
                param="tags",
            )
        if self.runner.graphs is not None:  # they point into the memory about to move
            self.runner.graphs.clear()
        if "kv_cache" in wanted and "kv_cache" not in self.released_memory:
            self.block_manager.reset_prefix_cache()  # its blocks' K/V are about to go
            self.model.free_kv_cache()
        if "weights" in wanted and "weights" not in self.released_memory:
            self.model.move_weights("cpu")
        self.released_memory |= wanted
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the trainer
        return sorted(self.released_memory)

    def resume_memory(self, tags: list[str] | None = None) -> list[str]:
        """Undo release_memory for `tags` (None: both): the weights come back as they were
        (or as an update loaded them meanwhile), the KV cache is allocated afresh. Returns
        what is still released."""
        wanted = _memory_tags(tags) & self.released_memory
        if "weights" in wanted:
            self.model.move_weights(self.device)
        graphs = self.runner.graphs
        if "kv_cache" in wanted and graphs is not None:
            graphs.init_kv_cache(self.config.num_kv_blocks, capture=False)
        elif "kv_cache" in wanted:
            self.model.init_kv_cache(
                self.config.num_kv_blocks, self.config.block_size, self.config.max_num_seqs, self.num_state_snapshots
            )
        self.released_memory -= wanted
        if graphs is not None and not self.released_memory:
            graphs.capture_all()  # over the cache and weights where they now lie
        return sorted(self.released_memory)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to do at one device)."""
        if self.executor is not None:
            self.executor.shutdown()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            released_memory=tuple(sorted(self.released_memory)),
            state_slots_total=bm.num_state_slots,
            state_slots_used=bm.num_used_state_slots,
        )

    @property
    def routed_experts_info(self) -> dict | None:
        if self.rows is None:
            return None
        mc = self.model_config
        return {
            "num_layers": mc.num_layers,
            "top_k": mc.top_k,
            "num_experts": mc.num_experts,
            "dtype": self.rows.dtype.name,
            "moe_layers": list(mc.moe_layers),
        }

    # -- the step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        result = StepResult()
        sched = self.scheduler.schedule()
        seqs = sched.seqs
        if not seqs:
            return result
        for s in seqs:
            if s.num_tokens - s.num_computed_tokens == s.num_scheduled_tokens and s.num_scheduled_tokens == 1:
                result.num_decode_tokens += 1
            else:
                result.num_prefill_tokens += s.num_scheduled_tokens
        if self.num_state_snapshots:  # a hybrid with prefix caching
            for s in seqs:
                self.block_manager.plan_snapshots(s)
        try:
            logits = self.runner.run(seqs)
        except Exception as exc:  # fail this step's requests, keep the engine alive
            for rid in dict.fromkeys(s.request_id for s in seqs):
                self._fail(rid, exc, result)
            return result

        touched: dict[str, Request] = {}
        if self.runner.prompt_logits is not None:
            try:
                self._record_prompt_logprobs(seqs)
            except Exception as exc:
                for i, _, _ in self.runner.prompt_spans:
                    self._fail(seqs[i].request_id, exc, result)
        to_sample: list[int] = []
        for i, seq in enumerate(seqs):
            if seq.is_finished:  # failed above
                continue
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.commit_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                to_sample.append(i)
        if to_sample:
            sampled_seqs = [seqs[i] for i in to_sample]
            try:
                # every row samples in a decode step: no index (a list index is a blocking copy on CUDA)
                rows = logits if len(to_sample) == len(seqs) else logits[to_sample]
                samples = sample(rows, sampled_seqs, self.eos_token_ids, self._sampling_generator)
            except Exception as exc:
                for rid in dict.fromkeys(s.request_id for s in sampled_seqs):
                    self._fail(rid, exc, result)
                return result
            now = time.monotonic()
            for seq, res in zip(sampled_seqs, samples):
                req = self.requests.get(seq.request_id)
                if req is None:  # failed earlier in this loop
                    continue
                try:
                    if req.first_token_time is None:
                        req.first_token_time = now
                    self._append(seq, res)
                    if req.deferred and seq.index == 0:
                        for sib in req.deferred:
                            self.scheduler.add(sib)
                        req.deferred = []
                except Exception as exc:  # e.g. a detokenizer error: fail this request only
                    touched.pop(seq.request_id, None)
                    self._fail(seq.request_id, exc, result)
                    continue
                touched[seq.request_id] = req
        for rid, req in touched.items():
            finished = req.finished
            if finished or req.prepared.output_kind is not OutputKind.FINAL_ONLY:
                result.outputs.append(self._output(req))
            if finished:
                del self.requests[rid]
        return result

    def _record_prompt_logprobs(self, seqs: list[Sequence]) -> None:
        """Append the prompt logprobs of this step's prompt rows (ModelRunner.prompt_spans)."""
        spans = self.runner.prompt_spans
        targets = [t for i, position, count in spans for t in seqs[i].token_ids[position + 1 : position + 1 + count]]
        num_top = [seqs[i].params.prompt_logprobs for i, _, count in spans for _ in range(count)]
        entries = prompt_logprobs(self.runner.prompt_logits, targets, num_top)
        first = 0
        for i, _, count in spans:
            seqs[i].prompt_logprobs.extend(entries[first : first + count])
            first += count

    def _fail(self, request_id: str, exc: BaseException, result: StepResult) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._stop_unfinished(req, "error")
        result.failed.append((request_id, exc))

    def _stop_unfinished(self, req: Request, reason: str) -> None:
        """Finish every sequence of `req` still running, waiting or deferred, freeing its blocks (and so its rows)."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = reason

    def _append(self, seq: Sequence, res) -> None:
        p = seq.params
        tok = res.token_id
        seq.token_ids.append(tok)
        if seq.logprobs is not None:
            seq.logprobs.append(res.top_logprobs)
            seq.cumulative_logprobs.append(seq.cumulative_logprob + res.logprob)
        n_out = seq.num_output_tokens
        stop_token = bool(p.stop_token_ids) and tok in p.stop_token_ids
        eos = not stop_token and not p.ignore_eos and tok in self.eos_token_ids
        # As vLLM: the text of a stop token or EOS is left out unless include_stop_str_in_output.
        delta = seq.detok.add(tok, silent=(stop_token or eos) and not p.include_stop_str_in_output)
        if stop_token:
            self._finish(seq, "stop", tok)
        elif eos:
            self._finish(seq, "stop", None)
        elif p.stop and n_out >= p.min_tokens and (hit := seq.detok.find_stop(p.stop, len(delta), p.include_stop_str_in_output)):
            stop, kept_len, kept_tokens = hit
            seq.detok.truncate(kept_len, kept_tokens)
            del seq.token_ids[seq.num_prompt_tokens + kept_tokens :]
            if seq.logprobs is not None:
                del seq.logprobs[kept_tokens:]
                del seq.cumulative_logprobs[kept_tokens:]
            self._finish(seq, "stop", stop)
        elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)
        seq.text = seq.detok.text

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        req = self.requests[seq.request_id]
        if req.prepared.return_routed_experts and self.rows is not None:
            # Rows of tokens 0 .. num_tokens-2: every token but the last sampled one ran.
            seq.routed_experts = self.rows.gather(
                seq.block_table.array,
                self.block_manager.block_size,
                seq.num_tokens - 1,
                req.prepared.params.routed_experts_prompt_start,
            )
        self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        prep = req.prepared
        delta = prep.output_kind is OutputKind.DELTA
        outs = [_completion(s, delta) for s in req.seqs]
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_latency_s"] = req.first_token_time - req.arrival_time
        return RequestOutput(
            request_id=prep.request_id,
            prompt=prep.prompt,
            prompt_token_ids=prep.prompt_token_ids,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=req.seqs[0].prompt_logprobs,
            weight_version=req.weight_version,
            metrics=metrics,
        )


def _completion(s: Sequence, delta: bool) -> CompletionOutput:
    """A sequence's output so far, or (delta) what is new since its previous output.

    While it runs, text (and the tokens producing it) that a stop string could still cut
    is held back, so every partial output is a prefix of the final one."""
    n, text_len = _visible(s)
    cumulative = None
    if s.logprobs is not None:
        cumulative = s.cumulative_logprobs[n - 1] if n else 0.0
    first_token, first_char = (s.num_emitted_tokens, s.num_emitted_chars) if delta else (0, 0)
    if delta:
        s.num_emitted_tokens, s.num_emitted_chars = n, text_len
    p0 = s.num_prompt_tokens
    return CompletionOutput(
        index=s.index,
        text=s.text[first_char:text_len],
        token_ids=s.token_ids[p0 + first_token : p0 + n],
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
        cumulative_logprob=cumulative,
        logprobs=s.logprobs[first_token:n] if s.logprobs is not None else None,
        routed_experts=s.routed_experts,
    )


def _visible(s: Sequence) -> tuple[int, int]:
    """(output tokens, text characters) that no stop string can still cut from `s`."""
    p = s.params
    if s.finish_reason is not None or not p.stop or p.include_stop_str_in_output:
        return s.num_output_tokens, len(s.text)
    # A stop string not seen yet ends in text still to come, so it starts at or after `safe`:
    # the final text keeps at least `safe` characters, and at least the tokens up to the
    # first one whose text reaches `safe` (tokens that add no text, such as the leading bytes
    # of a multi-byte character, stay held back until text follows them).
    safe = max(0, len(s.text) - (max(len(x) for x in p.stop) - 1))
    ends = s.detok.text_len_after
    n = min(bisect.bisect_left(ends, safe) + 1, bisect.bisect_right(ends, safe)) if safe else 0
    return n, ends[n - 1] if n else 0


def engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """EngineConfig's and ParallelConfig's fields as keywords."""
    parallel_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    parallel = ParallelConfig(**{name: kwargs.pop(name) for name in list(kwargs) if name in parallel_fields})
    try:
        return EngineConfig(model=model, parallel=parallel, **kwargs)
    except TypeError as e:  # an unknown keyword
        raise ConfigError(str(e)) from None


def _multiproc_executor(config: EngineConfig):
    if config.parallel.tensor_parallel_size == 1:
        return None
    from r3srv.engine.multiproc_executor import MultiprocExecutor, rank_setup

    return MultiprocExecutor(*rank_setup(config))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
