"""gpt-oss: biased attention with sinks, sliding-window layers (layer_types), a biased router
whose top-k logits are softmaxed, biased experts with a clamped SwiGLU, stored fused and
transposed."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import decoder_targets
from r3srv.models.families._parsing import layer_windows
from r3srv.models.parallel import transposed
from r3srv.models.specs import AttentionSpec, ExpertSpec, RouterSpec


def configure(cfg, raw, get):
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers)]
    bias = bool(raw.get("attention_bias", True))
    return replace(
        cfg,
        attention=AttentionSpec(qkv_bias=bias, o_bias=bias, sinks=True,
                                sliding_windows=layer_windows(raw, cfg.num_layers, "GptOssForCausalLM", default=alternating)),
        # a softmax over the top-k logits = the top-k softmax scores renormalised
        router=RouterSpec(renormalize=True, logit_bias=True),
        experts=ExpertSpec(activation="clamped_swiglu", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                           swiglu_limit=float(raw.get("swiglu_limit", 7.0))),
    )


def moe_targets(prefix, mlp):
    """Experts fused and transposed ([E, H, 2I] with gate/up columns interleaved, [E, I, H]):
    views of w13 (whose rows stay interleaved, see ops/experts.py's clamped_swiglu) and w2."""
    p, experts = prefix + "mlp.", mlp.experts
    b13, b2 = experts.bias_parts()
    return {
        p + "router.weight": mlp.gate,
        p + "router.bias": mlp.gate_bias,
        p + "experts.gate_up_proj": transposed(experts.w13_part()),
        p + "experts.gate_up_proj_bias": b13,
        p + "experts.down_proj": transposed(experts.w2_part()),
        p + "experts.down_proj_bias": b2,
    }


def weight_targets(model):
    return decoder_targets(model, moe_targets)


FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), configure, weight_targets)
