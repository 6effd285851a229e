"""DeepSeek-V3: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # MLA with a low-rank q; every attention width differs, so a mix-up cannot go unnoticed
    return transformers.DeepseekV3Config, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1, routed_scaling_factor=2.5,
    )


VARIANTS = {
    "deepseek_v3": {},
    # DeepSeek-V3's own switches: expert groups, YaRN with mscale (softmax scale and cos/sin),
    # a dense first layer, q without the low-rank pair, biased projections
    "deepseek_v3_groups_yarn": {
        "num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2, "num_layers": 3, "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "deepseek_v3_no_q_lora_not_interleaved": {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
}
