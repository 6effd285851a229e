"""MiniMax-M2: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # rotary_dim as the released configs spell partial RoPE (half of head_dim here)
    return transformers.MiniMaxM2Config, dict(
        num_local_experts=num_experts, intermediate_size=16, head_dim=16, rotary_dim=8
    )


VARIANTS = {
    "minimax_m2": {},
    "minimax_m2_32e_top8": {"num_experts": 32, "top_k": 8, "num_layers": 3},
}
