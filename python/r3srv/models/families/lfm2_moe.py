"""LFM2-MoE: gated short convolutions (layer_types "conv"; models/short_conv.py) beside attention
with per-head q/k norms; after num_dense_layers dense MLPs, a sigmoid router whose expert bias
only picks (DeepSeek-V3's scheme without groups). Its own names for the standard ones (its
experts: w1 gate, w3 up, w2 down, as its dense MLPs)."""

from __future__ import annotations

import re
from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.families._parsing import after_dense
from r3srv.models.specs import AttentionSpec, LinearAttentionSpec, RouterSpec

SPELLINGS = {"norm_eps": "rms_norm_eps", "tie_embedding": "tie_word_embeddings"}  # older releases: tie_embedding
NAMES = MoeNames(correction_bias=("feed_forward.expert_bias",))
RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"\.input_layernorm\.", ".operator_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."), (r"\.self_attn\.([qk])_norm\.", r".self_attn.\1_layernorm."),
    (r"\.mlp\.", ".feed_forward."), (r"\.gate_proj\.", ".w1."), (r"\.up_proj\.", ".w3."), (r"\.down_proj\.", ".w2."),
    (r"^model\.norm\.", "model.embedding_norm."),
)]


def configure(cfg, raw, get):
    n = cfg.num_layers
    types = raw.get("layer_types") or []
    if len(types) != n or set(types) - {"conv", "full_attention"}:
        raise ConfigError(f"Lfm2MoeForCausalLM: layer_types {types} must be {n} of conv / full_attention")
    return replace(
        cfg,
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=after_dense(int(raw.get("num_dense_layers") or 0), n),
        linear=LinearAttentionSpec(kind="short_conv", layers=[i for i, kind in enumerate(types) if kind == "conv"],
                                   conv_kernel=get.int("conv_L_cache", default=3),
                                   conv_bias=bool(raw.get("conv_bias", False))),
        attention=AttentionSpec(qk_norm="head"),
        router=RouterSpec(scoring="sigmoid", correction_bias=bool(raw.get("use_expert_bias", True)),
                          renormalize=bool(raw.get("norm_topk_prob", True)),
                          scaling=float(raw.get("routed_scaling_factor") or 1.0)),
    )


def lfm2_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


def weight_targets(model):
    targets = decoder_targets(model, lambda p, mlp: moe_targets(p, mlp, NAMES))
    return {lfm2_name(name): target for name, target in targets.items()}


FAMILY = Family("lfm2_moe", ("Lfm2MoeForCausalLM",), configure, weight_targets, spellings=SPELLINGS)
