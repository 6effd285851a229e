"""Where an engine's model runs: in this process, or over tensor-parallel ranks."""

from __future__ import annotations

import torch

from r3srv.engine.executor import InProcessExecutor


def load_model_for(config, dtype: torch.dtype | None):
    """What an engine's executor runs, and how: (model, tokenizer, executor class). At
    tensor_parallel_size 1 the checkpoint loaded in this process, run by an InProcessExecutor;
    beyond, the ranks' shards (worker processes and rank 0's here) driven as one model by a
    TensorParallelExecutor (engine/tensor_parallel.py)."""
    if config.parallel.tensor_parallel_size == 1:
        from r3srv.models.loader import load_model

        model, tokenizer = load_model(config.model, device=config.device, dtype=dtype,
                                      batch_invariant=config.batch_invariant)
        return model, tokenizer, InProcessExecutor
    from r3srv.engine.tensor_parallel import TensorParallelExecutor, start_ranks

    ranks = start_ranks(config)
    return ranks, ranks.tokenizer, TensorParallelExecutor
