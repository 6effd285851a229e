"""Mixtral: a softmax router over the top-k logits, a sliding_window over every layer, experts
named block_sparse_moe.experts.<e>.w1 / w3 / w2."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.specs import AttentionSpec, RouterSpec

NAMES = MoeNames(module="block_sparse_moe.", projections=("w1", "w3", "w2"))


def configure(cfg, raw, get):
    window = raw.get("sliding_window")
    return replace(cfg, router=RouterSpec(renormalize=True),
                   attention=AttentionSpec(sliding_windows=[int(window)] * cfg.num_layers if window else None))


def weight_targets(model):
    return decoder_targets(model, lambda p, mlp: moe_targets(p, mlp, NAMES))


FAMILY = Family("mixtral", ("MixtralForCausalLM",), configure, weight_targets)
