"""MiniMax-M2: Mixtral's layout and names with a sigmoid router and a correction bias (always
renormalised), q/k RMSNorm over all heads, partial RoPE."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.specs import AttentionSpec, RouterSpec

NAMES = MoeNames(module="block_sparse_moe.", projections=("w1", "w3", "w2"),
                 correction_bias=("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"))


def configure(cfg, raw, get):
    rope = raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor")
    if factor is None:  # released configs give `rotary_dim` (64 of head_dim 128)
        factor = raw["rotary_dim"] / cfg.head_dim if raw.get("rotary_dim") else raw.get("partial_rotary_factor", 1.0)
    if raw.get("shared_intermediate_size"):
        raise ConfigError("MiniMaxM2ForCausalLM: shared experts (shared_intermediate_size > 0) are not supported")
    return replace(
        cfg,
        attention=AttentionSpec(qk_norm="full"),
        rope=replace(cfg.rope, partial_factor=float(factor)),
        # float32 router logits: bf16 rounding kept out of which experts win, as for GLM-4.5
        router=RouterSpec(scoring="sigmoid", correction_bias=True, float32=True, renormalize=True),
    )


def weight_targets(model):
    return decoder_targets(model, lambda p, mlp: moe_targets(p, mlp, NAMES))


FAMILY = Family("minimax_m2", ("MiniMaxM2ForCausalLM",), configure, weight_targets)
