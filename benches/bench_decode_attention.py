"""Decode attention over a batch of mixed context lengths: length-sorted groups within a gather
budget against one group padded to the longest context (the previous layout).

    .venv/bin/python -m pytest benches/bench_decode_attention.py

32 decoding sequences, one with 4,096 tokens of context and 31 with 256 (a long agent
trajectory among short ones), the built-in model's attention shape (4 query heads, 2 KV
heads, head_dim 64). The padded layout gathers 32 x 4,096 keys and values; the grouped one
31 x 256 + 4,096. benches/conftest.py prints reference / r3srv.
"""

from __future__ import annotations

import pytest
import torch

import r3srv.ops.attention as attention
from r3srv.models.batch import ForwardBatch

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 64
CONTEXTS = [4096] + [256] * 31


def decode_batch() -> ForwardBatch:
    tables, next_block = [], 0
    for ctx in CONTEXTS:
        need = -(-ctx // BLOCK)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    width = max(len(t) for t in tables)
    table = torch.full((len(CONTEXTS), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    positions = torch.tensor([ctx - 1 for ctx in CONTEXTS])
    slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for i, p in enumerate(positions.tolist())])
    n = len(CONTEXTS)
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), positions=positions, slot_mapping=slots,
        query_lens=[1] * n, context_lens=list(CONTEXTS), block_tables=table,
        logits_indices=torch.arange(n),
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_decode_attention_mixed_lengths(benchmark, monkeypatch, candidate):
    gen = torch.Generator().manual_seed(0)
    batch = decode_batch()
    num_slots = (batch.block_tables.max().item() + 1) * BLOCK
    k_cache = torch.randn(num_slots, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_slots, KV_HEADS, DIM, generator=gen)
    q = torch.randn(len(CONTEXTS), HEADS, DIM, generator=gen)
    k, v = torch.randn(len(CONTEXTS), KV_HEADS, DIM, generator=gen), torch.randn(len(CONTEXTS), KV_HEADS, DIM, generator=gen)
    if candidate == "reference":
        monkeypatch.setattr(attention, "DECODE_GROUP_TOKENS", 1 << 40)  # one group, padded to the longest
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))
    assert len(meta.decode_groups(None)) == (1 if candidate == "reference" else 2)
    benchmark.group = "decode attention 1 x 4096 + 31 x 256"
    out = benchmark(attention.paged_attention, q, k, v, k_cache, v_cache, meta)
    monkeypatch.setattr(attention, "DECODE_GROUP_TOKENS", 1 << 40)
    want = attention.paged_attention(q, k, v, k_cache, v_cache, attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu")))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


WINDOW, LONG = 128, 4096


def masked_window_attention(q, k_cache, v_cache, meta, sinks):
    """The previous windowed decode: gather every context whole, mask keys outside the window."""
    out = torch.empty_like(q)
    for group in meta.decode_groups(None):
        ctx = torch.tensor([meta.context_lens[meta.decode_seqs[meta.decode_rows.index(r)]] for r in group.rows.tolist()])
        pos = torch.arange(group.slots.shape[1])
        mask = ((pos[None, :] < ctx[:, None]) & (pos[None, :] >= ctx[:, None] - WINDOW))[:, None, None, :]
        o = attention.attend(q.index_select(0, group.rows).unsqueeze(2), k_cache[group.slots].transpose(1, 2),
                             v_cache[group.slots].transpose(1, 2), mask, True, None, sinks)
        out.index_copy_(0, group.rows, o.squeeze(2))
    return out


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_sliding_window_decode(benchmark, candidate):
    """16 sequences of 4,096 tokens decoding in a 128-token window layer with sinks (gpt-oss)."""
    gen = torch.Generator().manual_seed(1)
    n, blocks = 16, LONG // BLOCK
    table = torch.arange(n * blocks, dtype=torch.int32).view(n, blocks)
    positions = torch.full((n,), LONG - 1)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), positions=positions,
        slot_mapping=table[:, -1].long() * BLOCK + BLOCK - 1, query_lens=[1] * n, context_lens=[LONG] * n,
        block_tables=table, logits_indices=torch.arange(n),
    )
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))
    k_cache = torch.randn(n * LONG, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(n * LONG, KV_HEADS, DIM, generator=gen)
    q, k, v = (torch.randn(n, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks = torch.randn(HEADS, generator=gen)
    out = attention.paged_attention(q, k, v, k_cache, v_cache, meta, window=WINDOW, sinks=sinks)
    torch.testing.assert_close(out, masked_window_attention(q, k_cache, v_cache, meta, sinks), rtol=1e-5, atol=1e-5)
    benchmark.group = f"sliding-window decode {n} x {LONG}, window {WINDOW}"
    if candidate == "reference":
        benchmark(masked_window_attention, q, k_cache, v_cache, meta, sinks)
    else:
        benchmark(attention.paged_attention, q, k, v, k_cache, v_cache, meta, window=WINDOW, sinks=sinks)
