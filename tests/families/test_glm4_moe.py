"""GLM-4.5/4.6 MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # GLM-4.6's switches: biased qkv, routed_scaling_factor 2.5, one shared expert, and
    # (transformers' default) partial rotary 0.5; all layers MoE unless overridden
    return transformers.Glm4MoeConfig, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
        first_k_dense_replace=0, attention_bias=True, routed_scaling_factor=2.5, n_shared_experts=1,
    )


VARIANTS = {
    "glm4_moe": {},
    "glm4_moe_dense_first_qk_norm": {
        "num_layers": 3, "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": False
    },
    "glm4_moe_groups_no_renorm": {
        "num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2, "norm_topk_prob": False
    },
    "glm4_moe_full_rotary_2_shared": {
        "rope_parameters": {"rope_theta": 500.0, "rope_type": "default", "partial_rotary_factor": 1.0},
        "n_shared_experts": 2,
    },
}
