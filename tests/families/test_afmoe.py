"""Arcee's AFMoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # Arcee's AFMoE: a window of 4 on the first layer (with RoPE), full attention without
    # positions on the second, sandwich norms, gated attention output, muP input scaling
    return transformers.AfmoeConfig, dict(
        num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16, num_dense_layers=0,
        num_shared_experts=1, route_scale=2.0, sliding_window=4, global_attn_every_n_layers=2, mup_enabled=True,
    )


VARIANTS = {
    # Arcee's AFMoE: windowed RoPE layers and position-free full layers, sandwich norms, gated output
    "afmoe": {},
    "afmoe_dense_first_4_layers": {"num_layers": 4, "num_dense_layers": 1, "mup_enabled": False},
}
