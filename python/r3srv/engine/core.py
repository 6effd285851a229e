"""The engine core: validated requests in, one step at a time, token-level updates out.

It owns the scheduler, the KV block and state pools, the slot-indexed routed-experts rows,
weight updates and memory release, and runs the model only through an Executor. It knows
tokens, never text: detokenizing, stop strings and RequestOutputs are the output
processor's, which tells the core when a stop string ended a sequence (`stop_sequence`).

Not thread-safe: the offline LLMEngine calls it from its own thread and AsyncLLM from its
one core thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from r3srv.config import EngineConfig
from r3srv.engine.block_manager import BlockManager
from r3srv.engine.executor import Executor
from r3srv.engine.indexer_topk import IndexerTopkBuffer, bytes_per_slot as indexer_bytes_per_slot
from r3srv.engine.placement import load_model_for
from r3srv.engine.input_processor import EngineRequest
from r3srv.engine.requests import CoreOutputs, CoreRequest, RequestUpdate, SeqUpdate
from r3srv.engine.routed_experts import RoutedExpertsBuffer, row_bytes_per_slot
from r3srv.engine.sampler import SampleResult
from r3srv.engine.scheduler import Scheduler
from r3srv.engine.sequence import Sequence
from r3srv.engine.stepper import Stepper
from r3srv.errors import ConfigError, InvalidRequestError
from r3srv.host_memory import available_bytes
from r3srv.models.vision import PREFIX as VISION_PREFIX
from r3srv.models.vision.updates import TowerUpdates

if TYPE_CHECKING:
    from r3srv.models.loader import NamedTensors

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default share of free memory for the KV cache when num_kv_blocks is not given.
_DEFAULT_KV_FRACTION = {"cpu": 0.25, "cuda": 0.85}
_CPU_KV_CAP_BYTES = 8 << 30

MEMORY_TAGS = ("kv_cache", "weights")  # SGLang's release/resume_memory_occupation tags


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




def _memory_tags(tags: list[str] | None) -> set[str]:
    if tags is None:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise InvalidRequestError(f"unknown memory tags {unknown}; expected any of {list(MEMORY_TAGS)}", param="tags")
    return set(tags)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        # the model here, or (tensor parallelism) the ranks' shards driven as one, and its executor
        model, self.tokenizer, executor_class = load_model_for(config, dtype)
        self.model_config = mc = model.config
        self.config = config = config.finalize(mc)
        self.lora = None  # the adapters served (r3srv.lora.manager) with enable_lora
        if config.enable_lora:
            from r3srv.lora.manager import LoraManager

            model.enable_lora(config.max_loras)
            self.lora = LoraManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                    max_cpu_loras=config.max_cpu_loras)
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.enable_return_routed_experts = config.enable_return_routed_experts
        eos = list(mc.eos_token_ids or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids = eos
        # a hybrid's linear-attention states: a slot per running sequence, and with prefix
        # caching as many snapshots again for the running ones plus as many kept for later hits
        self.num_state_slots = config.max_num_seqs if mc.is_hybrid else 0
        self.num_state_snapshots = 2 * self.num_state_slots if config.enable_prefix_caching else 0
        self.image_inputs, encoder = self._vision(mc, model.dtype)
        self.encoder = encoder  # the vision tower and its outputs by image (None: no images)
        self.executor: Executor = executor_class(
            model, config.block_size, self.device, config.enable_return_routed_experts, eos, config.seed,
            use_cuda_graphs=config.use_cuda_graphs, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, num_state_snapshots=self.num_state_snapshots,
            encoder=encoder, logprobs_mode=config.logprobs_mode,
            capture_weights=config.enable_return_routed_expert_weights,
            capture_indexer_topk=config.enable_return_indexer_topk,
        )
        self.tower_updates = TowerUpdates(None if encoder is None else encoder.tower,
                                          tensor_parallel=self.executor.ranks is not None)
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        self.config = config = config.with_kv_pool(num_blocks)
        # checked against the host's memory before the cache takes its share
        self.indexer_topk = (IndexerTopkBuffer.for_model(mc, num_blocks * config.block_size, self.max_model_len,
                                                         available=available_bytes())
                             if config.enable_return_indexer_topk else None)
        self.executor.init_kv_cache(num_blocks, config.block_size, config.max_num_seqs, self.num_state_snapshots)
        self._log_memory_plan(num_blocks)
        self.rows = (
            RoutedExpertsBuffer(num_blocks * config.block_size, mc.num_layers, mc.top_k, mc.num_experts,
                                config.enable_return_routed_expert_weights)
            if config.enable_return_routed_experts
            else None
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            num_state_slots=self.num_state_slots, num_state_snapshots=self.num_state_snapshots,
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_loras if config.enable_lora else 0,
                                   config.max_num_encoder_tokens, None if encoder is None else encoder.__contains__)
        self.weight_version = config.weight_version
        self.model_path = config.model  # the checkpoint the weights came from (None: the built-in model)
        self.requests: dict[str, CoreRequest] = {}
        self.released_memory: set[str] = set()  # MEMORY_TAGS given back by release_memory
        self.stepper = Stepper(self, overlapped=config.async_scheduling)

    def _vision(self, mc, dtype: torch.dtype):
        """A vision-language checkpoint's image inputs and its tower behind an encoder cache
        (None, None for any other model, or one whose directory lacks what images need). Under
        tensor parallelism the tower is whole on rank 0 (this process) and its outputs travel
        with the step's inputs (step_channel.py): it runs once per image, not once per rank."""
        from r3srv.engine.encoder_cache import EncoderCache
        from r3srv.models.vision import load_vision_tower
        from r3srv.vision.inputs import ImageInputConfig
        from r3srv.vision.processor import ImageProcessorConfig

        cfg = self.config
        if mc.vision is None or cfg.model is None:
            return None, None
        try:
            processor = ImageProcessorConfig.from_dir(cfg.model)
            tower = load_vision_tower(cfg.model, dtype=dtype, device=self.device)
        except ConfigError as exc:
            log.warning("image inputs off: %s (text and token prompts are served)", exc)
            return None, None
        inputs = ImageInputConfig(mc.vision, processor, cfg.max_images_per_prompt, cfg.max_image_pixels,
                                  embeds_width=tower.embeds_width)
        return inputs, EncoderCache(tower, self.device, dtype, cfg.encoder_cache_tokens)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to do at one device). Idempotent."""
        self.executor.shutdown()

    # -- sizing -------------------------------------------------------------------------
    def _log_memory_plan(self, num_blocks: int) -> None:
        """What each rank holds (rank 0's shard stands for all: the splits are even)."""
        weights = sum(p.numel() * p.element_size() for p in self.executor.shard.parameters())
        kv = num_blocks * self.executor.kv_cache_bytes_per_block(self.config.block_size)
        states = (self.num_state_slots + self.num_state_snapshots) * self.executor.state_bytes_per_slot()
        ranks = self.config.parallel.tensor_parallel_size
        log.info("memory per rank (%d rank%s): weights %.3f GiB, KV cache %.3f GiB (%d blocks of %d tokens)%s",
                 ranks, "s" if ranks > 1 else "", weights / 2**30, kv / 2**30, num_blocks, self.config.block_size,
                 f", linear-attention states {states / 2**30:.3f} GiB" if states else "")

    def _auto_num_blocks(self) -> int:
        cfg = self.config
        per_block = self.executor.kv_cache_bytes_per_block(cfg.block_size)
        mc = self.model_config
        if cfg.enable_return_routed_experts:  # the rows of a block's slots, in the buffer's dtype
            per_block += cfg.block_size * row_bytes_per_slot(mc.num_layers, mc.top_k, mc.num_experts)
        kind = self.device.type
        if cfg.enable_return_indexer_topk and kind == "cpu":  # host memory, the cache's own on the CPU
            per_block += cfg.block_size * indexer_bytes_per_slot(mc, self.max_model_len)
        fraction = cfg.kv_cache_memory_fraction or _DEFAULT_KV_FRACTION[kind]
        if kind == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * fraction)
        else:
            budget = min(int(available_bytes() * fraction), _CPU_KV_CAP_BYTES)
        budget -= self.executor.graphs_reserved
        # a hybrid's linear-attention states
        states = (self.num_state_slots + self.num_state_snapshots) * self.executor.state_bytes_per_slot()
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
    def add_request(self, prep: EngineRequest) -> None:
        if self.released_memory:
            raise InvalidRequestError(
                f"the engine's {' and '.join(sorted(self.released_memory))} memory is released: resume it first"
            )
        if prep.request_id in self.requests:
            raise InvalidRequestError(f"request_id {prep.request_id!r} is already in flight", param="request_id")
        p = prep.params
        lora = self.lora_ref(prep.lora_name)
        seqs = [Sequence(prep.request_id, i, prep.prompt_token_ids, p, prep.max_tokens, self._generator(p, i),
                         prep.multimodal, lora) for i in range(p.n)]
        req = CoreRequest(prep, seqs, weight_version=self.weight_version)
        self.requests[prep.request_id] = req
        self.scheduler.add(seqs[0])
        # With prefix caching, samples 1..n-1 wait until sample 0 has computed the prompt,
        # then share its full blocks instead of recomputing them.
        if self.config.enable_prefix_caching:
            req.deferred = seqs[1:]
        else:
            for seq in seqs[1:]:
                self.scheduler.add(seq)

    def _generator(self, params, index: int) -> torch.Generator | None:
        """A seeded request's own generator (its samples then depend on its seed alone)."""
        if params.greedy or params.seed is None:
            return None
        # n > 1: sample i of a seeded request uses seed + i (as vLLM's parallel sampling does).
        gen = torch.Generator(device=self.device)
        gen.manual_seed((params.seed + index) % (1 << 63))
        return gen

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Stop a request and free its blocks; the update ends its unfinished sequences ("abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        return self.request_update(req, self._stop_unfinished(req, "abort"))

    def stop_sequence(self, request_id: str, index: int, num_output_tokens: int, stop: str) -> CoreOutputs:
        """The output processor found stop string `stop` in sequence `index`: keep its first
        `num_output_tokens` output tokens and finish it ("stop"), with the rows of those tokens.
        Nothing if the sequence has finished meanwhile (its own update trims)."""
        out = CoreOutputs()
        req = self.requests.get(request_id)
        if req is None or req.seqs[index].is_finished:
            return out
        seq = req.seqs[index]
        del seq.token_ids[seq.num_prompt_tokens + num_output_tokens :]
        wants_rows = req.prepared.return_routed_experts and self.rows is not None
        if wants_rows and self.stepper.rows_stored_upto(seq) < seq.num_tokens - 1:
            # preempted or retracted since (its rows went with its blocks): recompute them first
            seq.finish_later = ("stop", stop, None)
            return out
        out.updates.append(self.request_update(req, [self.finish_sequence(seq, "stop", stop)]))
        self.forget_if_finished(req)
        return out

    def retract_running(self) -> int:
        """Send every running sequence back to the waiting queue with its blocks freed: its KV,
        state slot and routed-experts rows are recomputed when it runs again, on the weights
        loaded by then (a partial rollout resumed on a new policy). Returns how many."""
        self._drain()
        return self.scheduler.retract_running()

    def num_requests_holding_kv(self) -> int:
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
        from r3srv.models.loader import NamedTensors

        label = "tensors" if isinstance(path, NamedTensors) else str(path)
        self._drain()
        if holding := self.num_requests_holding_kv():
            raise InvalidRequestError(
                f"cannot update weights with {holding} requests in flight holding KV of the current weights: "
                "let them finish, abort them, or retract them (pause_generation mode=retract)",
                param="model_path",
            )
        tower_part, path = self.tower_updates.split(path)  # checked in full before any weight is copied
        # Released weights live in host memory: an update fills them there, and they move
        # back with resume_memory.
        try:
            if not isinstance(path, NamedTensors) or path.metas:  # not a push of the tower's tensors alone
                self.executor.load_weights(path)
            self.tower_updates.copy(tower_part)
        except ConfigError:
            raise  # found before any weight was copied: nothing changed
        except Exception:
            # Failed while copying (an I/O error mid-shard): some weights are new, some old.
            # Say so in every later output rather than serve a silent mix under the old name.
            self.block_manager.reset_prefix_cache()
            self._forget_encoded()
            self.weight_version = f"incomplete:{label}"
            raise
        self.block_manager.reset_prefix_cache()
        self._forget_encoded()
        self.weight_version = label if weight_version is None else weight_version
        self.model_path = None if isinstance(path, NamedTensors) else str(path)  # pushed tensors have no checkpoint
        for req in self.requests.values():  # none holds KV: every token of theirs is computed anew
            req.weight_version = self.weight_version

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        """Executor.unfilled_weights, and the vision tower's: reads shapes only (any thread may
        ask). The tower's tensors come all or none (none: it keeps its weights), so tensors of
        the tower alone are a complete update of it, and the language model's need none of it."""
        tower, rest = named.split(VISION_PREFIX)
        if not tower.metas:
            return self.executor.unfilled_weights(named)
        return (self.executor.unfilled_weights(rest) if rest.metas else []) + self.tower_updates.unfilled(tower)

    def _forget_encoded(self) -> None:
        """Drop the encoder's cached image outputs: after an update they are the old weights'
        (they must not stand in for images), and on a release they hold memory given back."""
        if self.encoder is not None:
            self.encoder.clear()

    def call_ranks(self, call):
        """`call(ranks)` (the executor's MultiprocExecutor) with no step in flight: a trainer's weight-group commands
        reach the tensor-parallel ranks over the channel the steps use (engine/weight_sync.py)."""
        self._drain()
        return call(self.executor.ranks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten."""
        return self.block_manager.reset_prefix_cache()

    # -- LoRA adapters (r3srv.lora) ------------------------------------------------------------
    def lora_ref(self, name: str | None):
        """The adapter a request names, at its current version (None: the base model)."""
        if name is None:
            return None
        if self.lora is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} asked for, but the server was started without "
                                      "--enable-lora", param="lora_name")
        return self.lora.ref(name)

    def load_lora_adapter(self, name: str, path: str | None = None, adapter=None, pinned: bool = False):
        """Register (or replace) an adapter; a replaced one's cached prefixes are dropped."""
        manager = self._lora_manager()
        old = manager.entries.get(name)
        old_key = None if old is None else self.lora_ref(name).cache_key
        if old is not None and any(s.lora is not None and s.lora.name == name for s in self.scheduler.running):
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by running requests: replace it once they "
                                      "finish (or pause with mode=retract or keep)", param="lora_name")
        ref = manager.load(name, path, adapter, pinned)
        if old_key is not None:
            self.block_manager.drop_extra_key(old_key)
            for seq in self.scheduler.waiting:  # holding no KV: they run on the new version
                if seq.lora is not None and seq.lora.name == name:
                    seq.lora = ref
        return ref

    def unload_lora_adapter(self, name: str):
        self._lora_manager()
        in_use = sorted({r.prepared.request_id for r in self.requests.values() for s in r.seqs
                         if s.lora is not None and s.lora.name == name and not s.is_finished})
        if in_use:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by requests {in_use[:4]}: unload it once "
                                      "they finish", param="lora_name")
        ref = self.lora.unload(name)
        self.block_manager.drop_extra_key(ref.cache_key)
        return ref

    def _lora_manager(self):
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need a server started with --enable-lora", param="lora_name")
        return self.lora

    def release_memory(self, tags: list[str] | None = None) -> list[str]:
        """Give memory back between rollout batches (a trainer colocated on the same GPU
        trains meanwhile): "kv_cache" frees the KV cache (and forgets the prefix cache and the
        encoder's cached image outputs), "weights" moves the weights, the vision tower's too,
        to pinned host memory. None: both. Only between requests; releasing something already
        released does nothing. Returns what is released."""
        wanted = _memory_tags(tags)
        self._drain()
        if self.requests:  # even retracted ones: nothing may wait to run in released memory
            raise InvalidRequestError(
                f"cannot release memory with {len(self.requests)} requests in flight: let them finish or abort them",
                param="tags",
            )
        if "kv_cache" in wanted and "kv_cache" not in self.released_memory:
            self.block_manager.reset_prefix_cache()  # its blocks' K/V are about to go
            self._forget_encoded()
            self.executor.free_kv_cache()
        if "weights" in wanted and "weights" not in self.released_memory:
            self.executor.release_weights()
            if self.encoder is not None:
                self.encoder.release_tower()
        self.released_memory |= wanted
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the trainer
        return sorted(self.released_memory)

    def resume_memory(self, tags: list[str] | None = None) -> list[str]:
        """Undo release_memory for `tags` (None: both): the weights come back as they were
        (or as an update loaded them meanwhile), the KV cache is allocated afresh. Returns
        what is still released."""
        wanted = _memory_tags(tags) & self.released_memory
        self._drain()
        if "weights" in wanted:
            self.executor.resume_weights()
            if self.encoder is not None:
                self.encoder.resume_tower()
        if "kv_cache" in wanted:
            cfg = self.config
            self.executor.init_kv_cache(cfg.num_kv_blocks, cfg.block_size, cfg.max_num_seqs, self.num_state_snapshots,
                                        capture_graphs=False)
        self.released_memory -= wanted
        if not self.released_memory:
            self.executor.capture_graphs()  # over the cache and weights where they now lie
        return sorted(self.released_memory)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.stepper.busy

    def _drain(self) -> None:
        """Overlapped scheduling: wait for the step in flight and book it (its outputs come with
        the next step), so a control call finds the device idle and no token unknown."""
        self.stepper.drain()

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
        info = {
            "num_layers": mc.num_layers,
            "top_k": mc.top_k,
            "num_experts": mc.num_experts,
            "dtype": self.rows.dtype.name,
            "moe_layers": list(mc.moe_layers),
        }
        if self.image_inputs is not None:  # image placeholders are positions with rows (docs/vision.md)
            info["images"] = {"image_token_id": mc.vision.image_token_id, "merge_size": mc.vision.merge_size}
        return info

    # -- the step -----------------------------------------------------------------------
    def step(self) -> CoreOutputs:
        """Schedule and run one step (overlapped: queue it and book the one before; engine/stepper.py)."""
        return self.stepper.step()

    # -- how requests end (the stepper's bookkeeping and the calls above share these) ----------
    def end_of(self, seq: Sequence, tok: int) -> tuple[str, int | None] | None:
        """The token-level stop checks for `tok`, the last of `seq.token_ids`: (finish_reason,
        stop_reason) if it ends the sequence. Stop strings are the output processor's."""
        p = seq.params
        if p.stop_token_ids and tok in p.stop_token_ids:
            return "stop", tok
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop", None
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: int | str | None,
                        res: SampleResult | None = None) -> SeqUpdate:
        """End `seq` (its blocks freed) with its rows when its request asked for them."""
        update = SeqUpdate(seq.index, res, reason, stop_reason, num_preempted=seq.num_preempted)
        prep = self.requests[seq.request_id].prepared
        if prep.return_routed_experts and self.rows is not None:
            update.routed_experts = self.rows.sequence_rows(seq.block_table.array, self.block_manager.block_size,
                                                            seq.num_tokens, prep.params.routed_experts_prompt_start)
            if prep.params.return_routed_expert_weights:  # checked against the flag on arrival
                update.routed_expert_weights = self.rows.sequence_weights(
                    seq.block_table.array, self.block_manager.block_size, seq.num_tokens,
                    prep.params.routed_experts_prompt_start)
        if prep.params.return_indexer_topk:  # checked against the flag and the model on arrival
            update.indexer_topk = self.indexer_topk.sequence(seq.block_table.array, self.block_manager.block_size,
                                                             seq.num_tokens, prep.params.indexer_topk_prompt_start)
        self.scheduler.finish(seq)
        return update

    def forget_if_finished(self, req: CoreRequest) -> None:
        if req.finished:
            self.requests.pop(req.prepared.request_id, None)

    def fail_request(self, request_id: str, exc: BaseException, result: CoreOutputs) -> None:
        """End every sequence of the request ("error"), freeing their blocks, and report it failed."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._stop_unfinished(req, "error")
        result.failed.append((request_id, exc))

    def _stop_unfinished(self, req: CoreRequest, reason: str) -> list[SeqUpdate]:
        """Finish every sequence of `req` still running, waiting or deferred, freeing its blocks (and so its rows)."""
        updates = []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                updates.append(SeqUpdate(seq.index, finish_reason=reason, num_preempted=seq.num_preempted))
        return updates

    def request_update(self, req: CoreRequest, seqs: list[SeqUpdate]) -> RequestUpdate:
        update = RequestUpdate(
            req.prepared.request_id, seqs, req.seqs[0].num_cached_tokens, req.weight_version,
            req.arrival_time, req.first_token_time,
        )
        first = req.seqs[0]
        if first.lora is not None:  # a replacement while it waited moves it to the new version
            update.lora = (first.lora.name, first.lora.version)
        if not req.prompt_logprobs_sent and first.prompt_logprobs is not None:
            if first.prompt_logprobs_done or req.finished:  # complete, or never will be
                update.prompt_logprobs = list(first.prompt_logprobs)  # the core thread may not touch it again
                req.prompt_logprobs_sent = True
        return update


class EngineFacts:
    """What callers (the server, LLM) read about the engine, for a front holding its EngineCore as `core`."""

    core: EngineCore

    @property
    def config(self) -> EngineConfig:
        """The engine's EngineConfig, finalized (KV pool size, block size, ...)."""
        return self.core.config

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype the weights and the KV cache are held in."""
        return self.core.executor.dtype

    @property
    def model_path(self) -> str | None:
        """The checkpoint directory of the weights now served (None: the built-in model)."""
        return self.core.model_path

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's and the tokenizer's end-of-sequence ids."""
        return self.core.eos_token_ids

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def enable_return_routed_experts(self) -> bool:
        return self.core.enable_return_routed_experts

    @property
    def routed_experts_info(self) -> dict | None:
        return self.core.routed_experts_info

    @property
    def weight_version(self) -> str:
        """The version of the weights requests admitted from now on run on."""
        return self.core.weight_version


