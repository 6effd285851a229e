"""DeepSeek-V3.2: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # DeepSeek-V3 with sparse attention: each query attends to its indexer's 5 best keys, so
    # prompts and decodes past 5 tokens attend sparsely (GLM-5, tests/families/test_glm_moe_dsa.py,
    # builds on this config). 16 indexer heads: with 4, one key in 16 scores exactly 0 (relu in
    # every head), and torch.topk breaks such ties differently on the CPU and CUDA (seen on an H200)
    return transformers.DeepseekV32Config, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=2.5,
        index_topk=5, index_n_heads=16, index_head_dim=16,
    )


VARIANTS = {
    # sparse attention: an indexer's top-5 keys per query (its own rotary layout per family)
    "deepseek_v32": {},
}
