"""Shared by the model tests: one whole-prompt forward of a loaded model through a fresh paged cache."""

from __future__ import annotations

import torch

from r3srv.models.batch import ForwardBatch

BLOCK_SIZE = 16


def prefill(model, tokens: list[int], *, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logits of the last token, or of every token with all_logits; int32 routing rows [T, layers, k])."""
    cfg = model.config
    t = len(tokens)
    blocks = -(-t // BLOCK_SIZE)
    model.init_kv_cache(blocks, BLOCK_SIZE)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(t),
        slot_mapping=torch.arange(t),
        query_lens=[t],
        context_lens=[t],
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        logits_indices=torch.arange(t) if all_logits else torch.tensor([t - 1]),
        routing_capture=torch.zeros(t, cfg.num_layers, cfg.top_k, dtype=torch.int32),
    )
    return model.forward(batch), batch.routing_capture
