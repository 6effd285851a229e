"""Nemotron-H: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # one mixer per layer: Mamba-2, MoE, attention (no positions), MoE, Mamba-2 again, a relu^2 MLP
    return transformers.NemotronHConfig, dict(
        n_routed_experts=num_experts, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        intermediate_size=48, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        routed_scaling_factor=1.5,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"],
    )


VARIANTS = {
    # Nemotron-H: Mamba-2 layers (prefill, then decodes continuing their states), attention
    # without positions, relu^2 experts under DeepSeek-V3's router (here with expert groups)
    "nemotron_h": {},
    "nemotron_h_groups_16e": {"num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2},
}
