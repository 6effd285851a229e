"""ERNIE-4.5-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # every layer MoE unless overridden; untied embeddings like the other tiny checkpoints
    return transformers.Ernie4_5_MoeConfig, dict(
        moe_num_experts=num_experts, moe_k=top_k, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
        moe_layer_start_index=0, moe_num_shared_experts=1,
    )


VARIANTS = {
    "ernie4_5_moe": {},
    "ernie4_5_moe_dense_interval_tied": {
        "num_layers": 4, "moe_layer_start_index": 1, "moe_layer_interval": 2, "moe_num_shared_experts": 2,
        "tie_word_embeddings": True,
    },
}
