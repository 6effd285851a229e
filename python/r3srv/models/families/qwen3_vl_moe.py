"""Qwen3-VL-MoE's language model: Qwen3-MoE's attention and layout, a router that always
renormalises; text prompts (its M-RoPE is plain RoPE for text, all three ids equal). Released
fused experts are [E, H, 2I] and [E, I, H], while transformers 5 saves them as it holds them
([E, 2I, H], [E, H, I])."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, qwen3_moe
from r3srv.models.families._names import in_language_model
from r3srv.models.families._parsing import vision_spec, with_mrope
from r3srv.models.specs import AttentionSpec, RouterSpec
from r3srv.models.vision.qwen3_vl import QwenVisionConfig, QwenVisionTower


def configure(cfg, raw, get):
    cfg = qwen3_moe.configure(cfg, raw, get)
    bias = bool(raw.get("attention_bias", False))
    return replace(cfg, router=RouterSpec(renormalize=True),
                   attention=AttentionSpec(qkv_bias=bias, o_bias=bias, qk_norm="head"),
                   rope=with_mrope(cfg.rope, raw, cfg.architecture, interleaved=True, rotary_dim=cfg.rotary_dim),
                   vision=vision_spec(raw, cfg.architecture))


def weight_targets(model):
    return in_language_model(qwen3_moe.weight_targets(model))


def vision_tower(raw, dtype, device):
    return QwenVisionTower(QwenVisionConfig.from_dict(raw, deepstack=True), dtype=dtype, device=device)


FAMILY = Family("qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), configure, weight_targets,
                transposed=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), vision_tower=vision_tower)
