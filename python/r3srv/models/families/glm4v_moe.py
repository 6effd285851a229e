"""GLM-4.5V's language model (glm4v_moe): GLM-4.5's decoder (sigmoid router with a correction
bias, gate-less shared experts, dense first layers, biased qkv, partial RoPE) under
model.language_model. Its M-RoPE splits the rotary frequencies into contiguous T / H / W
sections, which is plain RoPE where all three position ids are equal (text)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, glm4_moe
from r3srv.models.families._names import in_language_model
from r3srv.models.families._parsing import vision_spec, with_mrope
from r3srv.models.vision.glm4v import GlmVisionConfig, GlmVisionTower


def configure(cfg, raw, get):
    # transformers' Glm4vMoeTextConfig defaults: biased qkv, one dense first layer, partial 0.5
    cfg = glm4_moe.configure(cfg, {"attention_bias": True, "first_k_dense_replace": 1, **raw}, get)
    return replace(cfg, rope=with_mrope(cfg.rope, raw, cfg.architecture, interleaved=False, rotary_dim=cfg.rotary_dim),
                   vision=vision_spec(raw, cfg.architecture))


def weight_targets(model):
    return in_language_model(glm4_moe.weight_targets(model))


def vision_tower(raw, dtype, device):
    return GlmVisionTower(GlmVisionConfig.from_dict(raw), dtype=dtype, device=device)


FAMILY = Family("glm4v_moe", ("Glm4vMoeForConditionalGeneration",), configure, weight_targets,
                vision_tower=vision_tower)
