"""OLMoE: q/k RMSNorms over all heads, q/k/v clipped at clip_qkv, no renormalisation unless
norm_topk_prob."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets, moe_targets
from r3srv.models.specs import AttentionSpec, RouterSpec


def configure(cfg, raw, get):
    bias = bool(raw.get("attention_bias", False))
    return replace(cfg, attention=AttentionSpec(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=raw.get("clip_qkv")),
                   router=RouterSpec(renormalize=bool(raw.get("norm_topk_prob", False))))


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("olmoe", ("OlmoeForCausalLM",), configure, weight_targets)
