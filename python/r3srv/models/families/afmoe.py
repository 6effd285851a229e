"""Arcee's AFMoE (Trinity): sliding-window layers with RoPE and full-attention layers without, a
sigmoid gate projection on the attention output, per-head q/k norms, norms before and after each
branch, a sigmoid router with an expert bias, shared experts."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.families._parsing import after_dense, layer_windows
from r3srv.models.specs import AttentionSpec, ExpertSpec, RouterSpec, ScaleSpec

NAMES = MoeNames(correction_bias=("mlp.expert_bias",), shared="mlp.shared_experts.")
NORMS = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
         "post_attention_norm": "pre_mlp_layernorm", "mlp_out_norm": "post_mlp_layernorm"}


def configure(cfg, raw, get):
    n = cfg.num_layers
    every = int(raw.get("global_attn_every_n_layers") or 4)
    default = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    windows = layer_windows(raw, n, "AfmoeForCausalLM", default=default)
    width = get.int("moe_intermediate_size")
    bias = bool(raw.get("attention_bias", False))
    return replace(
        cfg,
        moe_intermediate_size=width,
        moe_layers=after_dense(int(raw.get("num_dense_layers") or 0), n),
        attention=AttentionSpec(qk_norm="head", qkv_bias=bias, o_bias=bias, sliding_windows=windows, gate_proj=True),
        rope=replace(cfg.rope, layers=[i for i in range(n) if windows is not None and windows[i] is not None]),
        norm=replace(cfg.norm, sandwich=True, weight_float32=True),
        router=RouterSpec(scoring="sigmoid", correction_bias=True, float32=True, renormalize=True,
                          scaling=float(raw.get("route_scale") or 1.0)),
        experts=ExpertSpec(shared_intermediate_size=width * int(raw.get("num_shared_experts") or 0), shared_gate=False),
        scales=ScaleSpec(embedding=get.int("hidden_size") ** 0.5 if raw.get("mup_enabled") else 1.0),
    )


def afmoe_moe_targets(p, mlp):
    """Its router holds the gate linear."""
    return moe_targets(p, mlp, NAMES) | {p + "mlp.router.gate.weight": mlp.gate}


def weight_targets(model):
    return decoder_targets(model, afmoe_moe_targets, norms=NORMS)


FAMILY = Family("afmoe", ("AfmoeForCausalLM",), configure, weight_targets)
