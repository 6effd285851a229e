"""Qwen3-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    return transformers.Qwen3MoeConfig, dict(
        num_experts=num_experts, intermediate_size=48, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True
    )


VARIANTS = {
    "qwen3_moe": {},
    "qwen3_moe_dense_layers": {"num_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2},
    "qwen3_moe_tied_embeddings": {"tie_word_embeddings": True},
    # sliding windows by each family's rule (a window of 4: prompts and decodes run past it)
    "qwen3_moe_sliding_window": {"use_sliding_window": True, "sliding_window": 4},
    "qwen3_moe_yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 8}},
}
