"""Routed-experts rows: a host buffer indexed by KV slot, and the per-sequence gather.

The model's MoE layers write the logical ids their router picked into the step's
capture tensor ([T, num_layers, top_k], zero-filled so dense layers stay zero). After
the step the rows are scattered into this buffer at the tokens' KV slots. A sequence's
array is then a gather through its block table, so prefix-cache hits (same blocks,
same slots) and recomputation after preemption (same tokens, recomputed rows) give the
rows the forward pass produced for those tokens.
"""

from __future__ import annotations

import numpy as np
import torch


def routed_experts_dtype(num_experts: int) -> np.dtype:
    """The wire dtype (DESIGN.md section 2): the narrowest of uint8 / uint16 / int32 that holds every id."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


# The capture tensor's torch dtype: uint8 where it fits, else int32 (widened ids are
# narrowed on the host; torch's uint16 has too few kernels to rely on).
def capture_torch_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int32


class RoutedExpertsBuffer:
    def __init__(self, num_slots: int, num_layers: int, top_k: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self.dtype = routed_experts_dtype(num_experts)
        self.capture_dtype = capture_torch_dtype(num_experts)
        # np.zeros maps pages lazily: untouched slots cost no memory.
        self.rows = np.zeros((num_slots, num_layers, top_k), dtype=self.dtype)

    def new_capture(self, num_tokens: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros((num_tokens, self.num_layers, self.top_k), dtype=self.capture_dtype, device=device)

    def store(self, slot_mapping: np.ndarray, capture: torch.Tensor) -> None:
        """Scatter one step's rows to their tokens' slots."""
        rows = capture.cpu().numpy()
        if rows.dtype != self.dtype:
            rows = rows.astype(self.dtype)
        self.rows[slot_mapping] = rows

    def gather(self, block_table: np.ndarray | list[int], block_size: int, num_rows: int, start: int = 0) -> np.ndarray:
        """Rows of tokens [start, num_rows) of a sequence, as a fresh C-contiguous array."""
        if num_rows <= start:
            return np.zeros((0, self.num_layers, self.top_k), dtype=self.dtype)
        positions = np.arange(start, num_rows)
        blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
        slots = blocks * block_size + positions % block_size
        return self.rows[slots]  # fancy indexing copies
