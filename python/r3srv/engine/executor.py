"""The executor: the one road from the engine core to the model.

The core decides what runs (a SchedulerOutput) and keeps the books (blocks, rows, requests);
the executor runs it and hands back a ModelOutput: the sampled tokens with their logprobs
and the step's captured routed-experts rows. It also carries the control calls that touch
the model's memory: weight updates, KV cache allocation and release, weights to the host
and back.

`InProcessExecutor` runs the model in this process; `TensorParallelExecutor`
(engine/tensor_parallel.py) runs rank 0's shard here and the others in worker processes, every
model call on each rank; the core does not change. The seam is also where CUDA graphs and
overlapped scheduling plug in: CUDA graphs live here (engine/cuda_graphs.py, replayed by the
model runner for decode steps; their memory is counted out of the KV budget), and `submit`
queues a step on a device thread and returns at once, its tokens read one step late
(engine/stepper.py; such steps run eagerly).
"""

from __future__ import annotations

import abc
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from r3srv.engine import cuda_graphs
from r3srv.engine.indexer_topk import IndexerTopkBuffer
from r3srv.engine.model_runner import ModelRunner
from r3srv.engine.routed_experts import RoutedExpertsBuffer, capture_torch_dtype
from r3srv.engine.sampler import SampleResult, SampleView, sample
from r3srv.engine.scheduler import SchedulerOutput
from r3srv.engine.sequence import Sequence
from r3srv.transfer import to_device

if TYPE_CHECKING:
    from r3srv.models.loader import NamedTensors

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step as the core hands it over: what runs, what samples, what else it keeps."""

    sched: SchedulerOutput
    # one per sched.sample_indices entry: the sequence as sampling reads it (a SampleView taken
    # when an overlapped step was queued; in a plain step, the sequence itself)
    samplers: list[SampleView | Sequence]
    # (sequence index, first position, count): the prompt positions whose logits the step keeps
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # overlapped steps: (position in the step's input ids, row in the previous submitted step's
    # samples), the tokens not sampled yet when this step was prepared, filled on the device
    holes: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ModelOutput:
    # one per StepInputs.samplers entry, in that order (empty if sampling failed)
    samples: list[SampleResult] = field(default_factory=list)
    sample_error: BaseException | None = None  # sampling failed: only the sampling sequences fail
    # the step's rows ([tokens, layers, top_k], possibly still on the device) and their KV slots
    routing_capture: torch.Tensor | None = None
    routing_weights: torch.Tensor | None = None  # the rows' router weights (float32), when captured
    indexer_topk: torch.Tensor | None = None  # the step's indexer selections (int32), when captured
    slot_mapping: np.ndarray | None = None
    # the logits of StepInputs.prompt_spans' positions ([R, vocab], run after run); None when none
    prompt_logits: torch.Tensor | None = None


class Executor(abc.ABC):
    """What the engine core asks of the model, wherever the model runs."""

    device: torch.device
    dtype: torch.dtype  # of the weights and the KV cache
    graphs_reserved: int = 0  # device bytes CUDA graphs take beside the KV cache (out of its budget)
    # tensor parallelism's ranks (engine/multiproc_executor.py's MultiprocExecutor: a trainer's
    # weight-group commands reach them through it); None in one process
    ranks = None

    @property
    def shard(self):
        """This process's model (rank 0's shard under tensor parallelism)."""
        return self.model

    def shutdown(self) -> None:
        """Stop whatever the executor started besides this process (nothing here). Idempotent."""

    @abc.abstractmethod
    def execute(self, step: StepInputs) -> ModelOutput:
        """Compute the scheduled tokens and sample for `step.samplers`, here and now. Raises if
        the forward pass fails (the core fails the step's requests)."""

    def submit(self, step: StepInputs) -> Future:
        """Overlapped scheduling: queue the step and return at once; the Future gives its
        ModelOutput. The step's inputs are read now; its holes are filled on the device, before
        the forward (and a sampler's pending output id before sampling), from the previous
        submitted step's samples."""
        raise NotImplementedError(f"{type(self).__name__} does not support overlapped scheduling")

    @abc.abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    @abc.abstractmethod
    def state_bytes_per_slot(self) -> int: ...

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_seqs: int, num_state_snapshots: int,
                      *, capture_graphs: bool = True) -> None:
        """Allocate the KV cache (and, with CUDA graphs, capture them over it unless told not to)."""

    @abc.abstractmethod
    def free_kv_cache(self) -> None: ...

    def capture_graphs(self) -> None:
        """Capture the decode graphs over the cache and weights where they now lie (none: nothing)."""

    @abc.abstractmethod
    def release_weights(self) -> None:
        """Move the weights to host memory (a colocated trainer uses the device meanwhile)."""

    @abc.abstractmethod
    def resume_weights(self) -> None: ...

    @abc.abstractmethod
    def load_weights(self, source: str | NamedTensors) -> None:
        """New weights of the same architecture from a checkpoint directory, or from tensors a
        trainer sent by name (received in full); ConfigError before any weight is copied leaves
        them unchanged."""

    @abc.abstractmethod
    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        """The parameters tensors so named, shaped and typed leave unfilled; a ConfigError naming
        any that cannot fill the model (unknown name, wrong shape or dtype). Reads shapes only."""


class InProcessExecutor(Executor):
    """The model in this process, driven by a ModelRunner; sampling on the same device."""

    def __init__(self, model, block_size: int, device: torch.device, capture_routed_experts: bool,
                 eos_token_ids: list[int], seed: int, *, use_cuda_graphs: bool = False, max_num_seqs: int = 1,
                 max_model_len: int = 1, num_state_snapshots: int = 0, encoder=None,
                 capture_weights: bool = False, capture_indexer_topk: bool = False,
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.model = model
        self.logprobs_mode = logprobs_mode  # what sampled logprobs hold (EngineConfig.logprobs_mode)
        self.device = device
        self.dtype = model.dtype
        self.eos_token_ids = eos_token_ids
        # Only the reusable capture tensor (no slots): the core stores what a step captured.
        mc = model.config
        capture = (RoutedExpertsBuffer(0, mc.num_layers, mc.top_k, mc.num_experts, capture_weights)
                   if capture_routed_experts else None)
        blocker = cuda_graphs.graph_blocker(model, capture_weights) if use_cuda_graphs else "not asked for"
        if use_cuda_graphs and blocker:
            log.warning("CUDA graphs off: %s", blocker)
        graphs = None if blocker else cuda_graphs.DecodeGraphs(
            model, block_size, max_num_seqs, max_model_len, num_state_snapshots,
            capture_torch_dtype(mc.num_experts) if capture_routed_experts else None)
        self.graphs_reserved = 0 if graphs is None else graphs.reserve()
        self.runner = ModelRunner(model, block_size, device, capture, graphs, encoder,
                                  IndexerTopkBuffer.for_model(mc, 0, max_model_len) if capture_indexer_topk else None)
        # Noise for requests without a seed: one generator, so their rows sample in one batched draw.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # overlapped scheduling: the one "device" thread steps run on, in order (on CUDA the
        # stream orders the kernels; the thread lets the host go on while they are queued and read)
        self._device_thread: ThreadPoolExecutor | None = None
        # the last step's sampled ids, on the device and on the host (the device thread only)
        self._last_tokens: tuple[torch.Tensor, list[int]] | None = None

    def execute(self, step: StepInputs) -> ModelOutput:
        run = self.runner.run(step.sched.seqs, step.prompt_spans)
        out = ModelOutput(routing_capture=run.capture, routing_weights=run.weights, slot_mapping=run.slot_mapping,
                          prompt_logits=run.prompt_logits, indexer_topk=run.indexer_topk)
        self._sample(out, run.logits, step.sched.sample_indices, step.samplers)
        return out

    def _sample(self, out: ModelOutput, logits: torch.Tensor, picked: list[int], samplers: list) -> None:
        if not picked:
            return
        try:
            # every row samples in a decode step: no index (a list index is a blocking copy on CUDA)
            rows = logits if len(picked) == logits.shape[0] else logits[picked]
            out.samples = sample(rows, samplers, self.eos_token_ids, self.generator, self.logprobs_mode)
        except Exception as exc:
            out.sample_error = exc

    def submit(self, step: StepInputs) -> Future:
        seqs = step.sched.seqs
        batch, slots = self.runner.prepare(seqs, step.prompt_spans)
        holes = step.holes
        holes_t = to_device([[h[0] for h in holes], [h[1] for h in holes]], self.device) if holes else None
        if self._device_thread is None:
            self._device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="r3srv-device")
        return self._device_thread.submit(self._run_queued, batch, slots, step, len(seqs), holes_t)

    def _run_queued(self, batch, slots: np.ndarray, step: StepInputs, num_seqs: int, holes) -> ModelOutput:
        last, self._last_tokens = self._last_tokens, None  # a failed step leaves none
        with torch.inference_mode():
            if holes is not None:
                # a hole's sequence failed last step when there is no token: it is discarded anyway
                batch.input_ids[holes[0]] = last[0][holes[1]] if last is not None else 0
            for view in step.samplers:  # a penalty's view of the previous sample (0: as for a hole)
                view.fill_pending(last[1] if last is not None else None)
            logits = self.model.forward(batch)
            prompt_logits = logits[num_seqs:] if step.prompt_spans else None
            # the capture tensor is reused by the next step, prepared meanwhile: keep this step's
            capture = None if batch.routing_capture is None else batch.routing_capture.clone()
            weights = None if batch.routing_weights is None else batch.routing_weights.clone()
            indexer = None if batch.indexer_capture is None else batch.indexer_capture.clone()
            out = ModelOutput(routing_capture=capture, routing_weights=weights, slot_mapping=slots,
                              prompt_logits=prompt_logits, indexer_topk=indexer)
            self._sample(out, logits[:num_seqs], step.sched.sample_indices, step.samplers)
            if out.samples:
                ids = [s.token_id for s in out.samples]
                self._last_tokens = (torch.tensor(ids, dtype=torch.int64, device=self.device), ids)
        return out

    def close(self) -> None:
        if self._device_thread is not None:
            self._device_thread.shutdown(wait=True)
            self._device_thread = None

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_bytes_per_block(block_size)

    def state_bytes_per_slot(self) -> int:
        return self.model.state_bytes_per_slot()

    def init_kv_cache(self, num_blocks: int, block_size: int, max_num_seqs: int, num_state_snapshots: int,
                      *, capture_graphs: bool = True) -> None:
        graphs = self.runner.graphs
        if graphs is None:
            self.model.init_kv_cache(num_blocks, block_size, max_num_seqs, num_state_snapshots)
        else:  # and the padding rows' scratch block and state entry
            graphs.init_kv_cache(num_blocks, capture=capture_graphs)

    def free_kv_cache(self) -> None:
        self._drop_graphs()
        self.model.free_kv_cache()

    def release_weights(self) -> None:
        self._drop_graphs()
        self.model.move_weights("cpu")

    def capture_graphs(self) -> None:
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()

    def _drop_graphs(self) -> None:
        if self.runner.graphs is not None:  # they point into the memory about to move
            self.runner.graphs.clear()

    def resume_weights(self) -> None:
        self.model.move_weights(self.device)

    def load_weights(self, source: str | NamedTensors) -> None:
        from r3srv.models.loader import NamedTensors, load_named_tensors, load_weights_from_dir

        (load_named_tensors if isinstance(source, NamedTensors) else load_weights_from_dir)(self.model, source)

    def unfilled_weights(self, named: NamedTensors) -> list[str]:
        from r3srv.models.loader import plan_named_tensors

        return plan_named_tensors(self.model, named, complete=False).missing
