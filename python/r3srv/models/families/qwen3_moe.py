"""Qwen3-MoE: per-head q/k norms, optional attention biases, every layer windowed when
use_sliding_window, MoE layers by mlp_only_layers / decoder_sparse_step."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets, moe_targets
from r3srv.models.families._parsing import qwen_moe_layers
from r3srv.models.specs import AttentionSpec, RouterSpec


def configure(cfg, raw, get):
    windowed = bool(raw.get("use_sliding_window")) and bool(raw.get("sliding_window"))
    bias = bool(raw.get("attention_bias", False))
    return replace(
        cfg,
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=qwen_moe_layers(raw, cfg.num_layers, cfg.num_experts),
        router=RouterSpec(renormalize=bool(raw.get("norm_topk_prob", False))),  # the HF default
        attention=AttentionSpec(qkv_bias=bias, o_bias=bias, qk_norm="head",
                                sliding_windows=[int(raw["sliding_window"])] * cfg.num_layers if windowed else None),
    )


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), configure, weight_targets)
