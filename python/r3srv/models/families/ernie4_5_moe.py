"""ERNIE-4.5 MoE: a float32 softmax router whose correction bias (moe_statics) steers the choice,
gate-less shared experts, MoE layers by start / end / interval, GPT-J-style RoPE, tied
embeddings by default."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.specs import ExpertSpec, RouterSpec

NAMES = MoeNames(shared="mlp.shared_experts.")
BIAS_NAMES = ("mlp.moe_statics.e_score_correction_bias", "mlp.gate.moe_statics.e_score_correction_bias")


def configure(cfg, raw, get):
    if raw.get("use_bias"):
        raise ConfigError("Ernie4_5_MoeForCausalLM: use_bias=true is not supported")
    width = get.int("moe_intermediate_size")
    start, every = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_interval") or 1)
    end = int(raw.get("moe_layer_end_index", -1))
    end = cfg.num_layers - 1 if end == -1 else end
    return replace(
        cfg,
        moe_intermediate_size=width,
        moe_layers=[i for i in range(cfg.num_layers) if (i + 1) % every == 0 and start <= i <= end],
        router=RouterSpec(renormalize=True, correction_bias=True, float32=True),
        rope=replace(cfg.rope, interleave=True),
        experts=ExpertSpec(shared_intermediate_size=width * int(raw.get("moe_num_shared_experts") or 0), shared_gate=False),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def ernie_moe_targets(p, mlp):
    """Its correction bias is stored as [1, E]."""
    return moe_targets(p, mlp, NAMES) | {p + name: mlp.correction_bias.view(1, -1) for name in BIAS_NAMES}


def weight_targets(model):
    return decoder_targets(model, ernie_moe_targets)


FAMILY = Family("ernie4_5_moe", ("Ernie4_5_MoeForCausalLM",), configure, weight_targets)
