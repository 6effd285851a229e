"""GLM-4.7-Flash: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # GLM-4.7-Flash: MLA (no partial rotary) with GLM's router; all layers MoE unless overridden
    return transformers.Glm4MoeLiteConfig, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        mlp_layer_types=["sparse"] * num_layers, routed_scaling_factor=1.8,
    )


VARIANTS = {
    "glm4_moe_lite": {},
    "glm4_moe_lite_dense_first": {"num_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
}
