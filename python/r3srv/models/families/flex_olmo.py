"""FlexOlmo: OLMoE's router and attention in OLMo-2's layout, each branch's output normalised
(no norm before a branch)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, olmoe
from r3srv.models.families._names import decoder_targets, moe_targets

NORMS = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}


def configure(cfg, raw, get):
    cfg = olmoe.configure(cfg, raw, get)
    return replace(cfg, norm=replace(cfg.norm, pre=False, sandwich=True))


def weight_targets(model):
    return decoder_targets(model, moe_targets, norms=NORMS)


FAMILY = Family("flex_olmo", ("FlexOlmoForCausalLM",), configure, weight_targets)
