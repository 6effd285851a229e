"""Qwen3-VL-MoE: its tiny transformers config and its oracle variants (checks: tests/family_oracle.py)."""

from functools import partial

from family_oracle import *  # noqa: F403 (the oracle checks, run on every entry of VARIANTS)


def tiny_config(transformers, *, num_experts, top_k, num_layers):
    # Qwen3-VL's language model (its checkpoint nests it beside a vision tower, here a tiny
    # one), M-RoPE sections that are plain RoPE for text
    text = {"num_experts": num_experts, "moe_intermediate_size": 8, "intermediate_size": 48,
            "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    return partial(image_text_config, transformers), text


def image_text_config(transformers, *, tie_word_embeddings, **text):
    """The image-text config around the text config; tied embeddings are the outer config's
    say, so the text config's (True by default) must not leak out."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                                         tie_word_embeddings=tie_word_embeddings)


def hf_model(transformers, config):
    """No causal-LM class: the image-text model, prompted with text."""
    return transformers.Qwen3VLMoeForConditionalGeneration(config)


VARIANTS = {
    # Qwen3-VL-MoE's language model, from its multimodal checkpoint (fused experts as transformers
    # 5 saves them); tied embeddings by the outer config
    "qwen3_vl_moe": {},
    "qwen3_vl_moe_tied_dense_layer": {"num_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": True},
}
