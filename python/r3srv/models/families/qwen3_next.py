"""Qwen3-Next: Gated DeltaNet layers (models/gated_deltanet.py) with a gated full-attention
layer every full_attention_interval (layer_types), zero-centred norms, Qwen2-MoE's gated
shared expert."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets, moe_targets
from r3srv.models.families._parsing import hybrid_layer_types, partial_rotary, qwen_moe_layers
from r3srv.models.specs import AttentionSpec, ExpertSpec, LinearAttentionSpec, RouterSpec


def with_gated_deltanet(cfg, raw, get, architecture: str, projection_layout: str):
    """Qwen3-Next's and Qwen3.5's layers, norms, attention and shared expert."""
    n = cfg.num_layers
    interval = int(raw.get("full_attention_interval") or 4)
    default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    layers = hybrid_layer_types(raw, n, architecture, default)
    width = get.int("moe_intermediate_size")
    linear = LinearAttentionSpec(
        kind="gated_deltanet", layers=layers,
        num_key_heads=get.int("linear_num_key_heads"), num_value_heads=get.int("linear_num_value_heads"),
        key_head_dim=get.int("linear_key_head_dim"), value_head_dim=get.int("linear_value_head_dim"),
        conv_kernel=get.int("linear_conv_kernel_dim", default=4), projection_layout=projection_layout,
    )
    bias = bool(raw.get("attention_bias", False))
    cfg = replace(
        cfg,
        moe_intermediate_size=width,
        experts=ExpertSpec(shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)),
        attention=AttentionSpec(qk_norm="head", qkv_bias=bias, o_bias=bias,
                                output_gate=bool(raw.get("attn_output_gate", True))),  # Qwen3.5 spells it out
        rope=replace(cfg.rope, partial_factor=partial_rotary(raw, 0.25)),
        norm=replace(cfg.norm, zero_centered=True),
        linear=linear,
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ConfigError(f"{architecture}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    return cfg


def configure(cfg, raw, get):
    cfg = with_gated_deltanet(cfg, raw, get, "Qwen3NextForCausalLM", "qkvz_ba")
    return replace(cfg, moe_layers=qwen_moe_layers(raw, cfg.num_layers, cfg.num_experts),
                   router=RouterSpec(renormalize=bool(raw.get("norm_topk_prob", True))))


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("qwen3_next", ("Qwen3NextForCausalLM",), configure, weight_targets)
