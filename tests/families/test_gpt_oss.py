"""gpt-oss: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # a window of 4 (every other layer) that prompts and decodes run past; transformers'
    # default YaRN (factor 32) scaled to the tiny context
    return transformers.GptOssConfig, dict(
        num_local_experts=num_experts, intermediate_size=16, head_dim=8, sliding_window=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False},
    )


VARIANTS = {
    "gpt_oss": {},
    # all-windowed layers and a SwiGLU limit low enough that the clamps bite
    "gpt_oss_windows_clamped": {
        "num_layers": 3, "layer_types": ["sliding_attention"] * 3, "swiglu_limit": 0.5, "top_k": 4
    },
}
