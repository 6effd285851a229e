"""DeepSeek Sparse Attention decode (models/dsa.py): each decode gathers only the keys its
indexer selected (r3srv), against attending over the whole context with the unselected keys
masked out (transformers' eager / SDPA form, the reference).

    .venv/bin/python -m pytest benches/bench_dsa_decode.py

One decode step of 8 sequences with 4,096-token contexts through one MLA layer of DeepSeek-V3.2's
per-head shape (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, 16 heads; indexer 16 heads of
128) selecting 256 keys (DeepSeek selects 2,048 of up to 163,840: the same 1/16 at 64k).
benches/conftest.py prints reference / r3srv.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.models import dsa
from r3srv.ops.attention import AttentionMetadata, DecodeGroup
from r3srv.models.batch import ForwardBatch
from r3srv.models.config import ModelConfig
from r3srv.ops.rotary import rope_cos_sin, rope_inv_freq
from r3srv.models.mla import MlaAttention

SEQS, CONTEXT, BLOCK, TOPK = 8, 4096, 16, 256
CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048, "kv_lora_rank": 512,
    "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 16,
    "num_hidden_layers": 1, "num_key_value_heads": 16, "q_lora_rank": 384, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 256, "n_group": 1, "topk_group": 1,
    "index_topk": TOPK, "index_n_heads": 16, "index_head_dim": 128,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def masked_dense_decode(indexer, group, query, weights):
    """The reference: the same selection as a mask over the whole gathered context (and the
    picks, as Indexer._decode returns them)."""
    real = group.slots.new_ones(group.slots.shape, dtype=torch.bool) if group.mask is None else group.mask[:, 0, 0]
    if real.shape[1] <= indexer.topk:
        return None, None
    scores = indexer._scores(query[group.rows], weights[group.rows], indexer.k_cache[group.slots].float())
    picked = scores.masked_fill(~real, float("-inf")).topk(indexer.topk, dim=-1).indices
    selected = torch.zeros_like(real).scatter_(1, picked, True) & real
    return DecodeGroup(group.rows, group.slots, selected[:, None, None, :]), picked


def decode_step(device: torch.device | str = "cpu"):
    """One MLA layer with an indexer, filled caches, and a decode step's inputs over them."""
    device = torch.device(device)
    cfg = ModelConfig.from_dict(CONFIG)
    torch.manual_seed(0)
    attn = MlaAttention(cfg, torch.float32, device)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    attn.allocate_cache(SEQS * CONTEXT, torch.float32, device)
    attn.k_cache.normal_()
    attn.indexer.k_cache.normal_()
    blocks = CONTEXT // BLOCK
    batch = ForwardBatch(
        input_ids=torch.zeros(SEQS, dtype=torch.int64), positions=torch.full((SEQS,), CONTEXT - 1),
        slot_mapping=torch.arange(SEQS) * CONTEXT + CONTEXT - 1, query_lens=[1] * SEQS, context_lens=[CONTEXT] * SEQS,
        block_tables=torch.arange(SEQS * blocks, dtype=torch.int32).view(SEQS, blocks), logits_indices=torch.arange(SEQS),
    )
    meta = AttentionMetadata.build(batch, BLOCK, device)
    inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope.theta).to(device)
    cos, sin = rope_cos_sin(batch.positions.to(device), inv_freq, torch.float32)
    x = torch.randn(SEQS, cfg.hidden_size, device=device)
    return attn, x, cos, sin, meta


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_dsa_decode_step(benchmark, candidate, monkeypatch):
    attn, x, cos, sin, meta = decode_step()
    with torch.inference_mode():
        got = attn(x, cos, sin, meta)
        monkeypatch.setattr(dsa.Indexer, "_decode", masked_dense_decode)
        want = attn(x, cos, sin, meta)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the same attention, either way
        if candidate == "r3srv":
            monkeypatch.undo()
        benchmark.group = f"DSA decode {SEQS}x{CONTEXT} top-{TOPK}"
        benchmark(attn, x, cos, sin, meta)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_dsa_decode_step_capturing_selections(benchmark, candidate):
    """--enable-return-indexer-topk's cost on the same step: the layer writing its selections into
    the step's capture and their copy into the host buffer by slot (r3srv), against the step
    without (the reference)."""
    from r3srv.engine.indexer_topk import IndexerTopkBuffer

    attn, x, cos, sin, meta = decode_step()
    buffer = IndexerTopkBuffer(SEQS * CONTEXT, 1, TOPK, CONTEXT)
    slots = meta.slot_mapping.cpu().numpy()

    def step():
        meta.indexer_capture = buffer.new_capture(SEQS, "cpu") if candidate == "r3srv" else None
        out = attn(x, cos, sin, meta)
        if meta.indexer_capture is not None:
            buffer.store(slots, meta.indexer_capture)
        return out

    with torch.inference_mode():
        benchmark.group = f"DSA decode {SEQS}x{CONTEXT} top-{TOPK}, capturing selections"
        benchmark(step)
    if candidate == "r3srv":  # each sequence's selection: top-k distinct positions of its context
        picked = buffer.values[slots, 0]
        assert all(len(set(row.tolist())) == TOPK and row.min() >= 0 and row.max() < CONTEXT for row in picked)
