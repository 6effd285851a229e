"""Qwen3.5-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from families.test_qwen3_next import hybrid_config
from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # the language model of Qwen3.5 (Qwen3_5MoeForCausalLM): Qwen3-Next's hybrid layout
    return transformers.Qwen3_5MoeTextConfig, hybrid_config(num_experts, num_layers)


VARIANTS = {
    # hybrids: Gated DeltaNet layers (prefill, then decodes continuing their states) and gated attention
    "qwen3_5_moe": {},
}
