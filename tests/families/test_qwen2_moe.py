"""Qwen2-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    return transformers.Qwen2MoeConfig, dict(
        num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24
    )


VARIANTS = {
    "qwen2_moe": {},
    "qwen2_moe_no_renorm_16e": {"num_experts": 16, "top_k": 4, "norm_topk_prob": False},
    # sliding windows by each family's rule (a window of 4: prompts and decodes run past it)
    "qwen2_moe_sliding_window": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
}
