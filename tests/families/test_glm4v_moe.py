"""GLM-4.5V (glm4v_moe): its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from functools import partial

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # GLM-4.5V's language model (its checkpoint nests it beside a vision tower, here a tiny
    # one): GLM-4.5's switches with M-RoPE sections over the partial rotary dims (8 of 16)
    text = {"n_routed_experts": num_experts, "intermediate_size": 48, "moe_intermediate_size": 16, "head_dim": 16,
            "first_k_dense_replace": 0, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1]}}
    return partial(image_text_config, transformers), text


def image_text_config(transformers, *, tie_word_embeddings, **text):
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  image_size=16, spatial_merge_size=2)
    return transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings)


def hf_model(transformers, config):
    """No causal-LM class: the image-text model, prompted with text."""
    return transformers.Glm4vMoeForConditionalGeneration(config)


VARIANTS = {
    # biased qkv (GLM-4.5V's default), routed_scaling_factor, one shared expert
    "glm4v_moe": {},
    # a dense first layer (GLM-4.5V's own first_k_dense_replace), expert groups, no renormalisation,
    # unbiased qkv, tied embeddings by the outer config
    "glm4v_moe_dense_first_groups": {
        "num_layers": 3, "first_k_dense_replace": 1, "num_experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": False, "attention_bias": False, "tie_word_embeddings": True,
    },
}
