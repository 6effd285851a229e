"""OLMoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    return transformers.OlmoeConfig, dict(num_experts=num_experts, intermediate_size=16, clip_qkv=3.0)


VARIANTS = {
    "olmoe": {"num_experts": 16, "top_k": 4},
    "olmoe_no_clip": {"clip_qkv": None},
}
