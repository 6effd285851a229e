"""GLM-4.5 / 4.6: a sigmoid router with a correction bias (choice only, float32), optional expert
groups and scaling, gate-less shared experts, dense first layers, partial RoPE."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.families._parsing import after_dense, partial_rotary
from r3srv.models.specs import AttentionSpec, ExpertSpec, RouterSpec

# e_score_correction_bias; transformers 5 in memory: mlp.e_score_correction_bias
NAMES = MoeNames(correction_bias=("mlp.gate.e_score_correction_bias",), shared="mlp.shared_experts.")


def router(raw) -> RouterSpec:
    """GLM-4.5's router, which DeepSeek-V3 and its descendants share."""
    return RouterSpec(scoring="sigmoid", correction_bias=True, float32=True,
                      renormalize=bool(raw.get("norm_topk_prob", True)),
                      scaling=float(raw.get("routed_scaling_factor", 1.0)),
                      num_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1))


def configure(cfg, raw, get):
    width = get.int("moe_intermediate_size")
    return replace(
        cfg,
        moe_intermediate_size=width,
        moe_layers=after_dense(int(raw.get("first_k_dense_replace", 1)), cfg.num_layers),  # the transformers default
        attention=AttentionSpec(qkv_bias=bool(raw.get("attention_bias", False)),
                                qk_norm="head" if raw.get("use_qk_norm") else None),
        rope=replace(cfg.rope, partial_factor=partial_rotary(raw, 0.5)),
        router=router(raw),
        experts=ExpertSpec(shared_intermediate_size=width * int(raw.get("n_shared_experts") or 0), shared_gate=False),
    )


def weight_targets(model):
    return decoder_targets(model, lambda p, mlp: moe_targets(p, mlp, NAMES))


FAMILY = Family("glm4_moe", ("Glm4MoeForCausalLM",), configure, weight_targets)
