"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step of a small batch is bound by the host: launching every layer's kernels takes
longer than the GPU takes to run them. A graph launches them all at once. It replays the
kernels it captured with the same arguments, so every input lives in a static device buffer
that each step overwrites (one pinned copy), and nothing in the forward pass may read the
host: the paged decode kernel takes the context lengths from the device and picks its split
from the bucket and max_model_len (ops/attention.py), the fused router writes the
routed-experts rows into a static capture buffer, a hybrid's recurrent layers update their
states in place (models/recurrent.py).

A step of n sequences runs the graph of the smallest bucket >= n; the padding rows are
dummies that must not touch real state: they write their K/V into a scratch block the block
manager never hands out, their recurrent state into a scratch entry, and their
routed-experts rows stay in the capture rows that are never stored. A hybrid's prefix-cache
snapshots of a decode step are copied after the replay. Prefills and mixed steps run eagerly.

The graphs share one memory pool; the engine measures a capture's pool use before it sizes
the KV cache and subtracts it (`reserved_bytes`).
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from r3srv.engine.sequence import Sequence
from r3srv.models.batch import ForwardBatch, GraphDecodeInputs
from r3srv.transfer import to_device

log = logging.getLogger(__name__)

# The step inputs that travel to the device, int64, in this order ahead of the block tables.
_SCALARS = ("input_ids", "positions", "slots", "context_lens", "state_slots")


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's ladder):
    a step pads at most 7 rows above 8 sequences."""
    ladder = [1, 2, 4] + list(range(8, max_num_seqs, 8))
    return sorted({b for b in ladder if b < max_num_seqs} | {max_num_seqs})


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows (None: more than the largest)."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def is_graph_decode(seqs: list[Sequence]) -> bool:
    """A step the graphs can run: every sequence computes one token after at least one cached
    (a one-token prompt is a prefill), and no hybrid state is restored into a slot (a prefix
    hit's first step, a prefill anyway). Snapshots are copied after the replay (`snapshot`).
    Nor a step under an adapter (graphs capture the base model's path only, docs/lora.md) or
    with an image prompt's token (it rotates by its M-RoPE ids, which a graph's positions do not
    carry)."""
    return all(s.num_scheduled_tokens == 1 and s.num_computed_tokens >= 1 and s.restore_from < 0
               and s.lora_slot < 0 and s.multimodal is None for s in seqs)


def graph_blocker(model, capture_weights: bool = False) -> str | None:
    """Why this model's decode steps cannot be captured (None: they can). `capture_weights`: the
    steps also capture the router's weights (a graph's capture holds the ids only)."""
    cfg = model.config
    if model.device.type != "cuda":
        return f"the model is on {model.device.type}, not CUDA"
    if capture_weights:
        return "routed expert weights are captured (--enable-return-routed-expert-weights)"
    if model.ops.batch_invariant:
        return "the batch-invariant expert pass reads each step's expert ids on the host"
    if model.ops.decode_attention is None:
        return ("no paged decode kernel (triton is not installed, or --no-triton-decode, $R3SRV_TRITON_DECODE=0): "
                "the torch decode path groups sequences on the host")
    if cfg.is_mla:
        return "multi-head latent attention decodes have no graph-safe path yet"
    moe = next((layer.mlp for layer in model.layers if layer.is_moe), None)
    if moe is not None:
        probe = torch.empty(0, cfg.hidden_size, dtype=model.dtype, device=model.device)
        if not moe.expert_pass.uses_grouped_mm(probe, moe.experts.w2):  # the per-expert loop reads its row counts on the host
            return f"the experts take the per-expert loop in {model.dtype} (grouped GEMMs need bfloat16)"
    return None


def reserved_bytes(pool_bytes: int, kv_bytes_per_block: int, state_bytes_per_slot: int) -> int:
    """Device memory the graphs take beside the KV cache: their pool, the padding rows'
    scratch KV block and (hybrids) scratch state entry."""
    return pool_bytes + kv_bytes_per_block + state_bytes_per_slot


def pad_decode_inputs(input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
                      state_slots: np.ndarray | None, bucket: int, table_width: int, block_size: int,
                      scratch_block: int, scratch_state: int) -> np.ndarray:
    """A decode step of n <= bucket sequences (0: all padding, for the capture) as the bucket's one int64 host array: input ids,
    positions, KV slots, context lengths and state slots ([bucket] each), then block tables
    [bucket, table_width] (-1 past each table). Padding rows are a one-token sequence at
    position 0 of the scratch block, in the scratch state entry."""
    n = len(input_ids)
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit the bucket of {bucket}")
    if tables.shape[1] > table_width:
        raise ValueError(f"block tables of {tables.shape[1]} blocks exceed the graphs' {table_width}")
    out = np.empty(bucket * (len(_SCALARS) + table_width), dtype=np.int64)
    head = out[: bucket * len(_SCALARS)].reshape(len(_SCALARS), bucket)
    real = (input_ids, positions, slots, positions + 1, np.zeros(n) if state_slots is None else state_slots)
    pad = (0, 0, scratch_block * block_size, 1, scratch_state)
    for row, values, filler in zip(head, real, pad):
        row[:n] = values
        row[n:] = filler
    table = out[bucket * len(_SCALARS):].reshape(bucket, table_width)
    table.fill(-1)
    table[:n, : tables.shape[1]] = tables
    table[n:, 0] = scratch_block
    return out


class DecodeGraphs:
    """The captured decode graphs of one model, their static inputs and outputs."""

    def __init__(self, model, block_size: int, max_num_seqs: int, max_model_len: int, num_state_snapshots: int,
                 capture_dtype: torch.dtype | None) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = batch_size_buckets(max_num_seqs)
        self.table_width = -(-max_model_len // block_size)
        self.max_num_seqs, self.num_state_snapshots = max_num_seqs, num_state_snapshots
        self.scratch_block = 0  # set by init_kv_cache: the block past the block manager's
        # a hybrid's state pool: max_num_seqs slots, the snapshots, then the padding rows' entry
        self.scratch_state = max_num_seqs + num_state_snapshots
        self.hybrid = cfg.is_hybrid
        device = model.device
        largest = self.buckets[-1]
        # every bucket's inputs are the leading elements of this buffer (one copy a step)
        self.inputs = torch.zeros(largest * (len(_SCALARS) + self.table_width), dtype=torch.int64, device=device)
        # zeroed once: dense layers' columns stay zero, MoE layers rewrite theirs every replay
        self.capture = (None if capture_dtype is None else
                        torch.zeros((largest, cfg.num_layers, cfg.top_k), dtype=capture_dtype, device=device))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.pool_bytes = 0  # reserved by the last capture_all

    def init_kv_cache(self, num_blocks: int, capture: bool = True) -> None:
        """The model's cache as the engine's init_kv_cache(num_blocks, ...) would allocate it, plus
        the padding rows' scratch block and state entry; then (capture) every bucket's graph."""
        self.clear()
        self.scratch_block = num_blocks
        self.model.init_kv_cache(num_blocks + 1, self.block_size, self.max_num_seqs, self.num_state_snapshots + 1)
        if capture:
            self.capture_all()

    def reserve(self) -> int:
        """Device bytes the graphs take beside the KV cache, measured before it is sized: a
        capture of the largest bucket (the buckets share its pool) over a two-block cache,
        one scratch block and one scratch state entry. Leaves no cache behind."""
        try:
            self.init_kv_cache(1, capture=False)
            pool = self.capture_all([self.buckets[-1]])
        finally:
            self.clear()
            self.model.free_kv_cache()
            torch.cuda.empty_cache()
        return reserved_bytes(pool, self.model.kv_cache_bytes_per_block(self.block_size),
                              self.model.state_bytes_per_slot())

    def batch(self, bucket: int) -> ForwardBatch:
        """The bucket's ForwardBatch over views of the static buffers (built inside the capture,
        so the few ops it runs are replayed too)."""
        head = self.inputs[: bucket * len(_SCALARS)].view(len(_SCALARS), bucket)
        ids, positions, slots, lens, state_slots = head
        tables = self.inputs[bucket * len(_SCALARS): bucket * (len(_SCALARS) + self.table_width)].view(
            bucket, self.table_width)
        graph = GraphDecodeInputs(
            context_lens=lens, max_context=self.max_model_len,
            state_slots=state_slots if self.hybrid else None,
            state_keep=(lens > 1).to(torch.float32) if self.hybrid else None,  # padding rows have one token
        )
        return ForwardBatch(
            input_ids=ids, positions=positions, slot_mapping=slots,
            query_lens=[1] * bucket, context_lens=[2] * bucket,  # never read in graph mode
            block_tables=tables, logits_indices=torch.arange(bucket, device=ids.device),
            routing_capture=None if self.capture is None else self.capture[:bucket], graph=graph,
        )

    @torch.inference_mode()
    def capture_all(self, buckets: list[int] | None = None) -> int:
        """Capture every bucket (largest first, so the smaller reuse its pool); returns the bytes
        the capture reserved. Every row is a padding row meanwhile: nothing real is written."""
        self.clear()
        device = self.inputs.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        self.pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self._fill_padding(bucket)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self.model.forward(self.batch(bucket))
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a server thread's CUDA call meanwhile does not void the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[bucket] = self.model.forward(self.batch(bucket))
            self.graphs[bucket] = graph
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        log.info("captured decode graphs for batch sizes %s (%.1f MiB)", sorted(self.graphs), self.pool_bytes / 2**20)
        return self.pool_bytes

    def _fill_padding(self, bucket: int) -> None:
        none = np.zeros(0, dtype=np.int64)
        host = pad_decode_inputs(none, none, none, none.reshape(0, 0), None, bucket, self.table_width,
                                 self.block_size, self.scratch_block, self.scratch_state)
        self.inputs[: host.size].copy_(torch.from_numpy(host))

    def clear(self) -> None:
        """Drop the graphs and their pool (before the KV cache or the weights move)."""
        self.graphs.clear()
        self.logits.clear()
        self.pool = None

    def load(self, seqs: list[Sequence], input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
             tables: np.ndarray) -> int:
        """Write a decode step's inputs, padded, into the static buffers; returns its bucket."""
        bucket = bucket_for(len(seqs), self.buckets)
        state_slots = np.fromiter((s.state_slot for s in seqs), np.int64, len(seqs)) if self.hybrid else None
        host = torch.from_numpy(pad_decode_inputs(input_ids, positions, slots, tables, state_slots, bucket,
                                                  self.table_width, self.block_size, self.scratch_block,
                                                  self.scratch_state))
        # pinned: the copy queues behind the last step instead of waiting for it
        self.inputs[: host.numel()].copy_(host.pin_memory() if self.inputs.is_cuda else host, non_blocking=True)
        return bucket

    def snapshot(self, seqs: list[Sequence]) -> None:
        """A hybrid's prefix-cache snapshots of this step: the states a sequence's token leaves
        in its slot, copied into the snapshot entries (a decode token is the last of its step,
        so after the replay is where the eager step copies them too)."""
        pairs = [(s.state_slot, entry) for s in seqs for _, entry in s.snapshot_plan]
        if not pairs:
            return
        slots, entries = to_device([[p[0] for p in pairs], [p[1] for p in pairs]], self.inputs.device)
        for layer in self.model.layers:
            if layer.linear_attn is not None:
                for pool in layer.linear_attn.pools():
                    pool.index_copy_(0, entries, pool.index_select(0, slots))

    def run(self, seqs: list[Sequence], input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay the bucket's graph for this decode step: float32 logits [n, vocab] and the
        routed-experts capture [n, layers, top_k] (views of the static outputs, valid until
        the next replay). None: no graph fits (the caller runs the step eagerly)."""
        bucket = bucket_for(len(seqs), self.buckets)
        if bucket is None or bucket not in self.graphs:
            return None
        self.load(seqs, input_ids, positions, slots, tables)
        self.graphs[bucket].replay()
        self.snapshot(seqs)
        n = len(seqs)
        return self.logits[bucket][:n], None if self.capture is None else self.capture[:n]
