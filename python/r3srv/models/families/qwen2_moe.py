"""Qwen2-MoE: biased q/k/v, a sigmoid-gated shared expert, windows by layer_types or
transformers' rule (even layers below max_window_layers)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets, moe_targets
from r3srv.models.families._parsing import layer_windows, qwen_moe_layers
from r3srv.models.specs import AttentionSpec, ExpertSpec, RouterSpec


def configure(cfg, raw, get):
    n = cfg.num_layers
    windowed = bool(raw.get("use_sliding_window")) and bool(raw.get("sliding_window"))
    start = n if raw.get("max_window_layers") is None else int(raw["max_window_layers"])
    rule = ["sliding_attention" if windowed and i % 2 == 0 and i < start else "full_attention" for i in range(n)]
    windows = layer_windows(raw if windowed else {**raw, "layer_types": None}, n, cfg.architecture, default=rule)
    return replace(
        cfg,
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=qwen_moe_layers(raw, n, cfg.num_experts),
        router=RouterSpec(renormalize=bool(raw.get("norm_topk_prob", False))),  # the HF default
        attention=AttentionSpec(qkv_bias=bool(raw.get("qkv_bias", True)),  # older configs have no key: always biased
                                sliding_windows=windows),
        experts=ExpertSpec(shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)),
    )


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), configure, weight_targets)
