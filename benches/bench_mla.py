"""Multi-head latent attention prefill: per-head keys and values expanded from the cached
latents (r3srv) against attending in the latent space (the decode path's form, used for
every token before).

    .venv/bin/python -m pytest benches/bench_mla.py

One 1,024-token prompt through one MLA layer of DeepSeek-V3's per-head shape (qk_nope 128,
qk_rope 64, v_head_dim 128, kv_lora_rank 512) with 16 heads. benches/conftest.py prints
reference / r3srv.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.ops.attention import AttentionMetadata, paged_attention
from r3srv.models.batch import ForwardBatch
from r3srv.models.config import ModelConfig
from r3srv.ops.rotary import rope_cos_sin, rope_inv_freq
from r3srv.models.mla import MlaAttention

TOKENS, BLOCK = 1024, 16
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048, "kv_lora_rank": 512,
    "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 16,
    "num_hidden_layers": 1, "num_key_value_heads": 16, "q_lora_rank": 384, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 256, "n_group": 1, "topk_group": 1,
}


def latent_prefill(attn: MlaAttention, x, cos, sin, meta):
    """The same layer attending in the latent space for every token (the absorbed form)."""
    t, h = x.shape[0], attn.num_heads
    q = torch.nn.functional.linear(x, attn.q_a)
    q = torch.nn.functional.linear(torch.nn.functional.rms_norm(q, (q.shape[-1],), attn.q_a_norm, 1e-6), attn.q_b_proj.weight)
    q_nope, q_rope = q.view(t, h, attn.nope + attn.rope).split([attn.nope, attn.rope], dim=-1)
    latent, k_rope = torch.nn.functional.linear(x, attn.kv_a).split([attn.rank, attn.rope], dim=-1)
    latent = torch.nn.functional.rms_norm(latent, (attn.rank,), attn.kv_a_norm, 1e-6)
    q_rope, k_rope = attn.rotate(q_rope, cos, sin), attn.rotate(k_rope.reshape(t, 1, attn.rope), cos, sin)
    kv_b = attn.kv_b_proj.weight.view(h, attn.nope + attn.v_dim, attn.rank)
    query = torch.cat((torch.einsum("thd,hdc->thc", q_nope, kv_b[:, : attn.nope]), q_rope), dim=-1)
    key = torch.cat((latent[:, None, :], k_rope), dim=-1)
    out = paged_attention(query, key, key[..., : attn.rank], attn.k_cache, attn.v_cache, meta, scale=attn.scale)
    out = torch.einsum("thc,hdc->thd", out, kv_b[:, attn.nope :])
    return torch.nn.functional.linear(out.reshape(t, -1), attn.o_proj.weight)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_mla_prefill(benchmark, candidate):
    cfg = ModelConfig.from_dict(CONFIG)
    torch.manual_seed(0)
    attn = MlaAttention(cfg, torch.float32, torch.device("cpu"))
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
    attn.allocate_cache(TOKENS, torch.float32, torch.device("cpu"))
    batch = ForwardBatch(
        input_ids=torch.zeros(TOKENS, dtype=torch.int64), positions=torch.arange(TOKENS), slot_mapping=torch.arange(TOKENS),
        query_lens=[TOKENS], context_lens=[TOKENS], block_tables=torch.arange(TOKENS // BLOCK, dtype=torch.int32)[None],
        logits_indices=torch.tensor([TOKENS - 1]),
    )
    meta = AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg.rotary_dim, cfg.rope.theta), torch.float32)
    x = torch.randn(TOKENS, cfg.hidden_size)
    with torch.inference_mode():
        want = latent_prefill(attn, x, cos, sin, meta)
        got = attn(x, cos, sin, meta)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the same attention, either way
        run = (lambda: latent_prefill(attn, x, cos, sin, meta)) if candidate == "reference" else (lambda: attn(x, cos, sin, meta))
        benchmark.group = f"MLA prefill {TOKENS} tokens, 16 heads"
        benchmark(run)
