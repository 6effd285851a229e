"""Qwen3.5 MoE: Qwen3-Next's layers with in_proj_qkv / z / b / a, every layer MoE, always
renormalised. Multimodal: its text_config is served (text prompts; its M-RoPE is plain RoPE for
text, where all three position ids are equal), under model.language_model."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, qwen3_next
from r3srv.models.families._names import in_language_model
from r3srv.models.families._parsing import vision_spec, with_mrope
from r3srv.models.specs import RouterSpec
from r3srv.models.vision.qwen3_vl import QwenVisionConfig, QwenVisionTower


def configure(cfg, raw, get):
    cfg = qwen3_next.with_gated_deltanet(cfg, raw, get, "Qwen3_5MoeForConditionalGeneration", "qkv_z_b_a")
    return replace(cfg, moe_layers=list(range(cfg.num_layers)), router=RouterSpec(renormalize=True),
                   rope=with_mrope(cfg.rope, raw, cfg.architecture, interleaved=True, rotary_dim=cfg.rotary_dim),
                   vision=vision_spec(raw, cfg.architecture))


def weight_targets(model):
    return in_language_model(qwen3_next.weight_targets(model))


def vision_tower(raw, dtype, device):
    return QwenVisionTower(QwenVisionConfig.from_dict(raw, deepstack=False), dtype=dtype, device=device)


FAMILY = Family("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), configure,
                weight_targets, vision_tower=vision_tower)
