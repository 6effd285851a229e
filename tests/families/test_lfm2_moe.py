"""LFM2-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # LFM2-MoE: gated short convolutions, then attention with per-head q/k norms; every layer
    # MoE unless num_dense_layers says; a sigmoid router whose expert bias changes picks
    return transformers.Lfm2MoeConfig, dict(
        num_experts=num_experts, moe_intermediate_size=16, intermediate_size=48, num_dense_layers=0,
        routed_scaling_factor=1.5, conv_L_cache=3,
        layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
    )


VARIANTS = {
    # LFM2-MoE: gated short convolutions (prefill, then decodes continuing their windows) beside
    # attention; a dense first layer and no expert bias in the second variant
    "lfm2_moe": {},
    "lfm2_moe_dense_first_no_bias_4_layers": {
        "num_layers": 4, "num_dense_layers": 1, "use_expert_bias": False, "norm_topk_prob": False
    },
}
