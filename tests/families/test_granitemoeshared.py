"""GraniteMoeShared: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from families.test_granitemoe import tiny_config as granitemoe_config
from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # Granite 3.x MoE's tiny config with a shared MLP beside the experts
    _, granite = granitemoe_config(transformers, num_experts=num_experts, top_k=top_k, num_layers=num_layers)
    return transformers.GraniteMoeSharedConfig, dict(granite, shared_intermediate_size=24)


VARIANTS = {
    # GraniteMoeShared: Granite 3.x MoE's RoPE attention with biases and muP-style scalars, a shared MLP
    "granitemoeshared_3_layers_16e": {"num_layers": 3, "num_experts": 16, "top_k": 4},
}
