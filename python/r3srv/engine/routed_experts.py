"""Routed-experts rows: a host buffer indexed by KV slot, and the per-sequence gather.

The model's MoE layers write the logical ids their router picked into the step's
capture tensor ([T, num_layers, top_k], zero-filled so dense layers stay zero). After
the step the rows are scattered into this buffer at the tokens' KV slots. A sequence's
array is then a gather through its block table, so prefix-cache hits (same blocks,
same slots) and recomputation after preemption (same tokens, recomputed rows) give the
rows the forward pass produced for those tokens.

From a CUDA capture the copy to the host is queued behind the step into pinned memory and
scattered at the next read or store: a synchronous copy would stall the host until the
forward ends, before it could queue the sampling kernels (docs/benchmarks.md, "Measurements
behind code choices": it cost more than the 1% budget).
"""

from __future__ import annotations

import numpy as np
import torch


def num_routed_rows(num_tokens: int, prompt_start: int = 0) -> int:
    """Rows of a sequence of `num_tokens` tokens from `prompt_start` on: every token but the last
    sampled one ran, so (num_tokens - 1 - prompt_start), none below zero (the wire contract's
    first axis)."""
    return max(0, num_tokens - 1 - prompt_start)


def routed_experts_dtype(num_experts: int) -> np.dtype:
    """The wire dtype (README.md, "The routed-experts contract"): the narrowest of uint8 /
    uint16 / int32 that holds every id."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def row_bytes_per_slot(num_layers: int, top_k: int, num_experts: int) -> int:
    """Host bytes a KV slot's row takes in the buffer (its wire dtype's: 1, 2 or 4 per id)."""
    return num_layers * top_k * routed_experts_dtype(num_experts).itemsize


# The capture tensor's torch dtype: uint8 where it fits, else int32 (widened ids are
# narrowed on the host; torch's uint16 has too few kernels to rely on).
def capture_torch_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int32


class RoutedExpertsBuffer:
    def __init__(self, num_slots: int, num_layers: int, top_k: int, num_experts: int,
                 with_weights: bool = False) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self.dtype = routed_experts_dtype(num_experts)
        self.capture_dtype = capture_torch_dtype(num_experts)
        # np.zeros maps pages lazily: untouched slots cost no memory.
        self.rows = np.zeros((num_slots, num_layers, top_k), dtype=self.dtype)
        self._capture: torch.Tensor | None = None  # the steps' capture, grown on demand
        self._pinned: torch.Tensor | None = None  # host staging for CUDA captures, grown on demand
        self._landed: torch.cuda.Event | None = None  # recorded behind each CUDA copy (one, re-recorded)
        self._pending: tuple[np.ndarray, torch.Tensor] | None = None
        # --enable-return-routed-expert-weights: each id's router weight (float32), kept like the ids
        self.weights = np.zeros((num_slots, num_layers, top_k), dtype=np.float32) if with_weights else None
        self._weight_capture: torch.Tensor | None = None

    def new_capture(self, num_tokens: int, device: torch.device | str) -> torch.Tensor:
        """The step's [num_tokens, layers, top_k] capture: the leading rows of one buffer, zeroed
        once. Every MoE layer's router writes all the step's rows of its column and no one
        writes a dense layer's, so no step needs to zero it again (a launch less a step). A
        step's rows are read (or their copy queued, in stream order) before the next step's
        routers run."""
        self._capture = step_buffer(self._capture, num_tokens, (self.num_layers, self.top_k), self.capture_dtype,
                                    device)
        return self._capture[:num_tokens]

    def new_weight_capture(self, num_tokens: int, device: torch.device | str) -> torch.Tensor | None:
        """The step's [num_tokens, layers, top_k] float32 weights capture (None without weights):
        every MoE layer's block copies its router's weights into its column; dense layers' stay 0."""
        if self.weights is None:
            return None
        self._weight_capture = step_buffer(self._weight_capture, num_tokens, (self.num_layers, self.top_k),
                                           torch.float32, device)
        return self._weight_capture[:num_tokens]

    def store_weights(self, slot_mapping: np.ndarray, weights: torch.Tensor) -> None:
        """Scatter one step's router weights to their tokens' slots (a synchronous copy from a
        device: the flag is opt-in and pays for it)."""
        self.weights[slot_mapping] = weights.cpu().numpy()

    def sequence_weights(self, block_table: np.ndarray | list[int], block_size: int, num_tokens: int,
                         prompt_start: int = 0) -> np.ndarray:
        """sequence_rows' weights: float32, the same shape, each the weight of the id at its place."""
        num_rows = prompt_start + num_routed_rows(num_tokens, prompt_start)
        return self.weights[token_slots(block_table, block_size, prompt_start, num_rows)]

    def store(self, slot_mapping: np.ndarray, capture: torch.Tensor) -> None:
        """Scatter one step's rows to their tokens' slots (from a CUDA capture: at the next
        read or store, once its queued copy has landed)."""
        self.flush()
        if not capture.is_cuda:
            self._scatter(slot_mapping, capture.numpy())
            return
        num_tokens = capture.shape[0]
        if self._pinned is None or self._pinned.shape[0] < num_tokens:
            self._pinned = torch.empty((max(num_tokens, 256), self.num_layers, self.top_k), dtype=capture.dtype,
                                       pin_memory=True)
        host = self._pinned[:num_tokens]
        host.copy_(capture, non_blocking=True)
        if self._landed is None:
            self._landed = torch.cuda.Event()
        self._landed.record(torch.cuda.current_stream(capture.device))  # the engine's GPU, current or not
        self._pending = (slot_mapping, host)

    def flush(self) -> None:
        """Scatter the last CUDA step's rows (waits for its copy; the step's sampling usually has)."""
        if self._pending is None:
            return
        slot_mapping, host = self._pending
        self._pending = None
        self._landed.synchronize()
        self._scatter(slot_mapping, host.numpy())

    def _scatter(self, slot_mapping: np.ndarray, rows: np.ndarray) -> None:
        self.rows[slot_mapping] = rows if rows.dtype == self.dtype else rows.astype(self.dtype)

    def sequence_rows(self, block_table: np.ndarray | list[int], block_size: int, num_tokens: int,
                      prompt_start: int = 0) -> np.ndarray:
        """A finished sequence's array: the rows of its `num_tokens` tokens from `prompt_start` on
        (num_routed_rows of them)."""
        return self.gather(block_table, block_size, prompt_start + num_routed_rows(num_tokens, prompt_start),
                           prompt_start)

    def gather(self, block_table: np.ndarray | list[int], block_size: int, num_rows: int, start: int = 0) -> np.ndarray:
        """Rows of tokens [start, num_rows) of a sequence, as a fresh C-contiguous array."""
        self.flush()
        if num_rows <= start:
            return np.zeros((0, self.num_layers, self.top_k), dtype=self.dtype)
        return self.rows[token_slots(block_table, block_size, start, num_rows)]  # fancy indexing copies


def step_buffer(buffer: torch.Tensor | None, num_tokens: int, tail: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """`buffer` if it holds num_tokens rows of shape `tail` on `device`, else a zeroed larger one
    (a step's capture, grown on demand and never zeroed again: every writer fills its column)."""
    device = torch.device(device)
    if buffer is None or buffer.device != device or buffer.shape[0] < num_tokens:
        buffer = torch.zeros((max(num_tokens, 256), *tail), dtype=dtype, device=device)
    return buffer


def token_slots(block_table: np.ndarray | list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """The KV slots of a sequence's positions [start, end) (none when end <= start)."""
    positions = np.arange(start, max(start, end))
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
