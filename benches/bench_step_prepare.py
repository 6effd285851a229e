"""Host-side step preparation (ModelRunner.prepare) against the list-based build it replaced.

    .venv/bin/python -m pytest benches/bench_step_prepare.py

Decode steps of B sequences with C-token contexts: the runner copies every block table
into the step's padded table and computes one KV slot per token. The reference is the
previous implementation (block tables as Python lists, converted element by element,
and one slot per token in Python);
benches/conftest.py prints reference / r3srv per shape. On a GPU this work is pure host
overhead in front of every forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3srv.engine.block_table import BlockTable
from r3srv.engine.model_runner import ModelRunner
from r3srv.engine.sequence import Sequence
from r3srv.models.batch import ForwardBatch
from r3srv.sampling_params import SamplingParams

BLOCK_SIZE = 16
SHAPES = [(1, 2048), (64, 8192), (256, 32768)]  # (sequences, context tokens)


def list_based_prepare(seqs: list[Sequence], tables_as_lists: list[list[int]], bs: int):
    """The previous ModelRunner.prepare (commit 324caa4), tensors included."""
    input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
    for seq, table in zip(seqs, tables_as_lists):
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        end = start + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        if n == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
        query_lens.append(n)
        context_lens.append(end)
    tables = np.full((len(seqs), max(len(t) for t in tables_as_lists)), -1, dtype=np.int32)
    for i, table in enumerate(tables_as_lists):
        tables[i, : len(table)] = table
    slot_np = np.asarray(slots, dtype=np.int64)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.from_numpy(slot_np),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=torch.from_numpy(tables),
        logits_indices=torch.tensor(np.cumsum(query_lens) - 1, dtype=torch.int64),
    )
    return batch, slot_np


def decode_step(num_seqs: int, context: int) -> list[Sequence]:
    seqs = []
    blocks_each = -(-context // BLOCK_SIZE)
    for i in range(num_seqs):
        seq = Sequence(str(i), 0, [i % 256] * context, SamplingParams(), 16, None)
        seq.block_table = BlockTable(range(i * blocks_each, (i + 1) * blocks_each))
        seq.num_computed_tokens, seq.num_scheduled_tokens = context - 1, 1
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("num_seqs, context", SHAPES, ids=[f"{b}x{c}" for b, c in SHAPES])
def test_prepare_decode_step(benchmark, num_seqs, context, candidate):
    seqs = decode_step(num_seqs, context)
    runner = ModelRunner(None, BLOCK_SIZE, torch.device("cpu"), None)
    lists = [list(s.block_table) for s in seqs]
    benchmark.group = f"prepare {num_seqs}x{context}"
    if candidate == "reference":
        batch, slots = benchmark(list_based_prepare, seqs, lists, BLOCK_SIZE)
    else:
        batch, slots = benchmark(runner.prepare, seqs)
    want, want_slots = list_based_prepare(seqs, lists, BLOCK_SIZE)  # both candidates build the same step
    assert np.array_equal(slots, want_slots)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "logits_indices"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert (batch.query_lens, batch.context_lens) == (want.query_lens, want.context_lens)
