"""GLM-5 (GlmMoeDsa): its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from families.test_deepseek_v32 import tiny_config as deepseek_v32_config
from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # DeepSeek-V3.2's sparse attention (its tiny config); the second layer shares the first's choice
    _, dsa = deepseek_v32_config(transformers, num_experts=num_experts, top_k=top_k, num_layers=num_layers)
    return transformers.GlmMoeDsaConfig, dict(dsa, indexer_types=["full"] + ["shared"] * (num_layers - 1))


VARIANTS = {
    # sparse attention: an indexer's top-5 keys per query (its own rotary layout per family)
    "glm_moe_dsa": {},
    # three layers: full, shared, full; a dense first layer; a wider selection than the prompt
    "glm_moe_dsa_full_shared_full": {
        "num_layers": 3, "indexer_types": ["full", "shared", "full"], "first_k_dense_replace": 1
    },
}
