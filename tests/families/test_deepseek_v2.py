"""DeepSeek-V2: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # V2-Lite's shape: no low-rank q, two shared experts, softmax routing scaled
    return transformers.DeepseekV2Config, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.5,
    )


VARIANTS = {
    "deepseek_v2": {},
    # V2's group_limited_greedy (a group scores its best expert), a low-rank q, YaRN with mscale
    "deepseek_v2_groups_q_lora_yarn": {
        "num_experts": 16, "top_k": 4, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "q_lora_rank": 24, "num_layers": 3, "first_k_dense_replace": 1,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 8, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}
