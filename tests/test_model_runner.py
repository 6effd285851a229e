"""The model runner's step preparation against a per-token reference, and BlockTable's list behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.engine.block_table import BlockTable
from r3srv.engine.model_runner import ModelRunner
from r3srv.engine.sequence import Sequence
from r3srv.sampling_params import SamplingParams


def reference_prepare(seqs: list[Sequence], bs: int) -> dict:
    """Every field built token by token, straight from the definitions in ForwardBatch."""
    input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
    for seq in seqs:
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        table = list(seq.block_table)
        for pos in range(start, start + n):
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        query_lens.append(n)
        context_lens.append(start + n)
    width = max(len(s.block_table) for s in seqs)
    tables = [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in seqs]
    return dict(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        logits_indices=(np.cumsum(query_lens) - 1).tolist(),
    )


@st.composite
def steps(draw):
    """A step mixing decodes, whole prefills and chunks after cached prefixes, over distinct blocks."""
    bs = draw(st.sampled_from([1, 4, 16]))
    next_block = draw(st.integers(0, 50))
    seqs = []
    for i in range(draw(st.integers(1, 8))):
        computed = draw(st.integers(0, 100))
        scheduled = draw(st.sampled_from([1, draw(st.integers(1, 60))]))
        total = computed + scheduled
        seq = Sequence(f"r{i}", 0, [draw(st.integers(0, 255)) for _ in range(total)], SamplingParams(), 8, None)
        num_blocks = -(-total // bs) + draw(st.integers(0, 2))  # sometimes a spare block, as after grow()
        seq.block_table = BlockTable(range(next_block, next_block + num_blocks))
        next_block += num_blocks + draw(st.integers(0, 3))
        seq.num_computed_tokens, seq.num_scheduled_tokens = computed, scheduled
        seqs.append(seq)
    return bs, seqs


@pytest.mark.slow  # 200 generated steps
@settings(max_examples=200, deadline=None)
@given(steps())
def test_prepare_matches_the_per_token_reference(step):
    bs, seqs = step
    batch, slot_np = ModelRunner(None, bs, torch.device("cpu"), None).prepare(seqs)
    want = reference_prepare(seqs, bs)
    for name, expected in want.items():
        got = getattr(batch, name)
        got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        assert got == expected, name
    assert slot_np.tolist() == want["slot_mapping"]
    assert batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
    assert batch.block_tables.dtype == batch.logits_indices.dtype == torch.int64


def test_block_table_acts_as_an_append_only_list():
    table = BlockTable()
    assert len(table) == 0 and not table and table == [] and list(table) == []
    reference: list[int] = []
    for block_id in range(0, 300, 7):  # grows past the initial capacity several times
        table.append(block_id)
        reference.append(block_id)
    assert table == reference and list(table) == reference and list(reversed(table)) == reference[::-1]
    assert table[0] == reference[0] and table[-1] == reference[-1] and table[3:9] == reference[3:9]
    assert isinstance(table[5], int) and table.array.dtype == np.int32
    assert table.array.tolist() == reference
    assert table != reference[:-1] and table != reference[:-1] + [999]
    with pytest.raises(IndexError):
        table[len(reference)]
    with pytest.raises(IndexError):
        table[-len(reference) - 1]
    assert BlockTable([3, 4]) == BlockTable((3, 4)) and BlockTable([3, 4]) != BlockTable([4, 3])
