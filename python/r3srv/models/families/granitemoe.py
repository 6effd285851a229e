"""Granite 3.x MoE: attention with RoPE then Mixtral's router (a softmax over the top-k logits)
over SwiGLU experts stored fused (input_linear: gate then up rows; output_linear); muP-style
scalars on embeddings, residual branches, attention and logits (transformers' defaults: 1.0
each)."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets
from r3srv.models.specs import AttentionSpec, ExpertSpec, RouterSpec, ScaleSpec


def with_granite_scalars(cfg, raw, **attention):
    """Granite's router, shared MLP (where shared_intermediate_size says), scalars and biases."""
    bias = bool(raw.get("attention_bias", False))
    return replace(
        cfg,
        router=RouterSpec(renormalize=True),  # a softmax over the top-k logits
        attention=AttentionSpec(qkv_bias=bias, o_bias=bias, scale=float(raw.get("attention_multiplier", 1.0)), **attention),
        experts=ExpertSpec(shared_intermediate_size=int(raw.get("shared_intermediate_size") or 0), shared_gate=False),
        scales=ScaleSpec(embedding=float(raw.get("embedding_multiplier", 1.0)),
                         residual=float(raw.get("residual_multiplier", 1.0)),
                         logits=float(raw.get("logits_scaling", 1.0))),
    )


def configure(cfg, raw, get):
    return with_granite_scalars(cfg, raw)


def moe_targets(prefix, mlp):
    """Granite's fused experts and its shared MLP."""
    p, experts = prefix + "block_sparse_moe.", mlp.experts
    targets = {p + "router.layer.weight": mlp.gate, p + "router.weight": mlp.gate,
               p + "input_linear.weight": experts.w13_part(), p + "output_linear.weight": experts.w2_part(),
               p + "experts.gate_up_proj": experts.w13_part(), p + "experts.down_proj": experts.w2_part()}
    if mlp.shared is not None:
        targets[prefix + "shared_mlp.input_linear.weight"] = mlp.shared.gate_up.part()
        targets[prefix + "shared_mlp.output_linear.weight"] = mlp.shared.down.part()
    return targets


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("granitemoe", ("GraniteMoeForCausalLM",), configure, weight_targets)
