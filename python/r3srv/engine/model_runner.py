"""Turns a scheduled step into a ForwardBatch, runs the model, and keeps the step's rows.

The model owns its paged KV cache (`init_kv_cache`); this module only tells it where
each token's KV goes (slot mapping) and where each sequence's context lives (block
tables). When routed experts are enabled every step captures rows, whether or not
its requests asked for them: a later request may hit these blocks in the prefix cache.
"""

from __future__ import annotations

import numpy as np
import torch

from r3srv.engine.routed_experts import RoutedExpertsBuffer
from r3srv.engine.sequence import Sequence
from r3srv.models.batch import ForwardBatch


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device, rows: RoutedExpertsBuffer | None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.rows = rows

    def prepare(self, seqs: list[Sequence]) -> tuple[ForwardBatch, np.ndarray]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                for pos in range(start, end):
                    slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            context_lens.append(end)
        width = max(len(s.block_table) for s in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        slot_np = np.asarray(slots, dtype=np.int64)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.from_numpy(slot_np).to(dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.from_numpy(tables).to(dev),
            logits_indices=torch.tensor(np.cumsum(query_lens) - 1, dtype=torch.int64, device=dev),
            routing_capture=None if self.rows is None else self.rows.new_capture(len(input_ids), dev),
        )
        return batch, slot_np

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Computes the scheduled tokens of `seqs`; returns float32 logits [len(seqs), vocab]."""
        batch, slot_np = self.prepare(seqs)
        logits = self.model.forward(batch)
        if self.rows is not None:
            self.rows.store(slot_np, batch.routing_capture)
        return logits
