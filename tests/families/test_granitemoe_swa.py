"""GraniteMoeSWA: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # granite-swash: GraniteMoeShared with a window of 4 in every layer but each fourth (from
    # the first), a learned sink per head, the fully attending layers without positions
    # (layer_rope_theta 0), every muP-style scalar away from 1
    return transformers.GraniteMoeSWAConfig, dict(
        num_local_experts=num_experts, intermediate_size=16, shared_intermediate_size=24, attention_bias=True,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        sliding_window=4, layer_rope_theta=[0.0 if i % 4 == 0 else 10000.0 for i in range(num_layers)],
    )


VARIANTS = {
    # GraniteMoeSWA: windows and sinks, position-free full layers; without layer_rope_theta every
    # layer rotates by the one base (5 layers: two full, three windowed)
    "granitemoe_swa": {},
    "granitemoe_swa_rope_everywhere_5_layers": {"num_layers": 5, "layer_rope_theta": None},
}
