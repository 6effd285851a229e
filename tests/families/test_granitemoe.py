"""Granite 3.x MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # Granite 3.x MoE (and its shared-MLP variant, tests/families/test_granitemoeshared.py):
    # attention with RoPE, every muP-style scalar away from 1 so that a forgotten one shows;
    # biased attention projections
    return transformers.GraniteMoeConfig, dict(
        num_local_experts=num_experts, intermediate_size=16, attention_bias=True,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
    )


VARIANTS = {
    # Granite 3.x MoE: RoPE attention with biases, muP-style scalars
    "granitemoe": {},
}
