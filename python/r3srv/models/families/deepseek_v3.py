"""DeepSeek-V3 (and Kimi-K2, Moonlight): GLM-4.5's router and MoE layout with multi-head latent
attention (models/mla.py)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, glm4_moe
from r3srv.models.specs import AttentionSpec, MlaSpec


def check_router(raw, architecture: str) -> None:
    if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(
            f"{architecture}: scoring_func={raw.get('scoring_func')!r} / topk_method={raw.get('topk_method')!r} "
            "is not supported (only DeepSeek-V3's sigmoid / noaux_tc router)"
        )


def with_mla(cfg, raw, get, first_dense_default: int):
    """cfg with DeepSeek-V2/V3's multi-head latent attention (and their MoE layer rule: dense
    before first_k_dense_replace, then every moe_layer_freq-th)."""
    first_dense = int(raw.get("first_k_dense_replace", first_dense_default))
    every = int(raw.get("moe_layer_freq") or 1)
    rope_dim = get.int("qk_rope_head_dim")
    bias = bool(raw.get("attention_bias", False))
    mla = MlaSpec(kv_lora_rank=get.int("kv_lora_rank"), q_lora_rank=int(raw.get("q_lora_rank") or 0),
                  qk_nope_head_dim=get.int("qk_nope_head_dim"), v_head_dim=get.int("v_head_dim"))
    return replace(
        cfg,
        head_dim=rope_dim,
        num_kv_heads=get.int("num_attention_heads"),  # the latent expands to every head
        attention=AttentionSpec(qkv_bias=bias, o_bias=bias, mla=mla),
        rope=replace(cfg.rope, partial_factor=1.0, interleave=bool(raw.get("rope_interleave", True))),
        moe_layers=[i for i in range(first_dense, get.int("num_hidden_layers")) if i % every == 0],
    )


def configure(cfg, raw, get):
    check_router(raw, "DeepseekV3ForCausalLM")
    return with_mla(glm4_moe.configure(cfg, raw, get), raw, get, first_dense_default=3)


FAMILY = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), configure, glm4_moe.weight_targets)
