"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (models/dsa.py; its indexer rotates
index keys by halves), always interleaved MLA rotary."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, deepseek_v3, glm4_moe
from r3srv.models.families._parsing import mlp_layer_types
from r3srv.models.specs import SparseIndexSpec


def with_sparse_attention(cfg, raw, get, architecture: str, *, interleave: bool, types: list[str] | None = None):
    """DeepSeek-V3's config with sparse attention; `types` (full / shared per layer) when
    indexer_types is not in config.json (default: every layer has its own indexer)."""
    deepseek_v3.check_router(raw, architecture)
    cfg = deepseek_v3.with_mla(glm4_moe.configure(cfg, raw, get), raw, get, first_dense_default=3)
    n = cfg.num_layers
    moe_layers = mlp_layer_types(raw, n, architecture, cfg.moe_layers)
    types = raw.get("indexer_types") or types or ["full"] * n
    if len(types) != n or set(types) - {"full", "shared"} or types[0] != "full":
        raise ConfigError(f"{architecture}: indexer_types {types} must be {n} of full / shared, the first full")
    if raw.get("q_lora_rank") in (None, 0):
        raise ConfigError(f"{architecture}: sparse attention needs q_lora_rank (its indexer reads the low-rank query)")
    sparse = SparseIndexSpec(topk=get.int("index_topk"), n_heads=get.int("index_n_heads"),
                             head_dim=get.int("index_head_dim"), rope_interleave=interleave,
                             shared_layers=[i for i, t in enumerate(types) if t == "shared"])
    return replace(cfg, moe_layers=moe_layers,
                   rope=replace(cfg.rope, interleave=True), attention=replace(cfg.attention, sparse=sparse))


def configure(cfg, raw, get):
    return with_sparse_attention(cfg, raw, get, "DeepseekV32ForCausalLM", interleave=False)


FAMILY = Family("deepseek_v32", ("DeepseekV32ForCausalLM",), configure, glm4_moe.weight_targets)
