"""dots.llm1: DeepSeek-V3's router and MoE layout under Qwen3's attention (per-head q/k norms,
full rotary, windows by layer_types)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, glm4_moe
from r3srv.models.families._parsing import after_dense, layer_windows
from r3srv.models.specs import AttentionSpec


def configure(cfg, raw, get):
    cfg = glm4_moe.configure(cfg, raw, get)
    bias = bool(raw.get("attention_bias", False))
    return replace(
        cfg,
        moe_layers=after_dense(int(raw.get("first_k_dense_replace", 0)), cfg.num_layers),
        router=replace(cfg.router, renormalize=bool(raw.get("norm_topk_prob", False))),
        rope=replace(cfg.rope, partial_factor=1.0),
        attention=AttentionSpec(qk_norm="head", qkv_bias=bias, o_bias=bias,
                                sliding_windows=layer_windows(raw, cfg.num_layers, "Dots1ForCausalLM")),
    )


FAMILY = Family("dots1", ("Dots1ForCausalLM",), configure, glm4_moe.weight_targets)
