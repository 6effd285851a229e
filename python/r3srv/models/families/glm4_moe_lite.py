"""GLM-4.7-Flash: DeepSeek-V3's attention and GLM-4.5's router; dense layers by mlp_layer_types."""

from __future__ import annotations

from dataclasses import replace

from r3srv.models.families import Family, deepseek_v3, glm4_moe
from r3srv.models.families._parsing import mlp_layer_types


def configure(cfg, raw, get):
    cfg = deepseek_v3.with_mla(glm4_moe.configure(cfg, raw, get), raw, get, first_dense_default=1)
    return replace(cfg, moe_layers=mlp_layer_types(raw, cfg.num_layers, "Glm4MoeLiteForCausalLM", cfg.moe_layers))


FAMILY = Family("glm4_moe_lite", ("Glm4MoeLiteForCausalLM",), configure, glm4_moe.weight_targets)
