"""Mixtral: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    return transformers.MixtralConfig, dict(num_local_experts=num_experts, intermediate_size=16)


VARIANTS = {
    "mixtral": {},
    # sliding windows by each family's rule (a window of 4: prompts and decodes run past it)
    "mixtral_sliding_window": {"sliding_window": 4},
}
