"""Kimi-Linear: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # KDA layers around one MLA layer without positions; every layer MoE unless overridden
    return transformers.KimiLinearConfig, dict(
        num_local_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.0,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)],
        mlp_layer_types=["sparse"] * num_layers,
    )


VARIANTS = {
    # Kimi-Linear: Kimi Delta Attention (per-channel decay) and MLA without positions
    "kimi_linear": {},
    "kimi_linear_dense_first_3_layers": {
        "num_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"], "num_experts": 16, "top_k": 4
    },
}
