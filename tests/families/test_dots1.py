"""dots.llm1: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # dots.llm1: a window of 4 on the last layer (max_window_layers), one shared expert
    return transformers.Dots1Config, dict(
        n_routed_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
        n_shared_experts=1, routed_scaling_factor=2.0, sliding_window=4, max_window_layers=num_layers - 1,
        norm_topk_prob=True,
    )


VARIANTS = {
    "dots1": {},
    "dots1_dense_first_groups": {"num_layers": 3, "first_k_dense_replace": 1, "num_experts": 16, "top_k": 4,
                                 "n_group": 4, "topk_group": 2, "norm_topk_prob": False},
}
