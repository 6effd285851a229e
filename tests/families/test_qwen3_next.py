"""Qwen3-Next: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    return transformers.Qwen3NextConfig, dict(hybrid_config(num_experts, num_layers), intermediate_size=48)


def hybrid_config(num_experts, num_layers):
    """Qwen3-Next's and Qwen3.5's (tests/families/test_qwen3_5_moe.py) hybrid layout."""
    # hybrid: Gated DeltaNet layers and a gated full-attention layer every second one;
    # two value heads per key head, partial RoPE (transformers' default 0.25)
    return dict(
        num_experts=num_experts, moe_intermediate_size=16, shared_expert_intermediate_size=24, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
    )


VARIANTS = {
    # hybrids: Gated DeltaNet layers (prefill, then decodes continuing their states) and gated attention
    "qwen3_next": {},
    # transformers' layer rule (a full-attention layer every 4th), a dense layer, one value head per key head
    "qwen3_next_interval_dense_layer": {
        "num_layers": 4, "layer_types": None, "mlp_only_layers": [2], "linear_num_value_heads": 2
    },
}
