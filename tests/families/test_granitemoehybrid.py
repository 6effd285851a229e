"""Granite-4.0-H: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # Granite-4.0-H: Mamba-2 and attention without positions, a shared MLP beside the experts,
    # every muP-style scalar away from 1 so that a forgotten one shows
    return transformers.GraniteMoeHybridConfig, dict(
        num_local_experts=num_experts, intermediate_size=16, shared_intermediate_size=24, mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, position_embedding_type="nope",
        layer_types=["attention" if i % 2 else "mamba" for i in range(num_layers)],
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
    )


VARIANTS = {
    # Granite-4.0-H: Mamba-2 beside attention, muP-style scalars, an always-on shared MLP; with RoPE too
    "granitemoehybrid": {},
    "granitemoehybrid_rope_3_layers": {"num_layers": 3, "position_embedding_type": "rope"},
}
