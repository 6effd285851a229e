"""Granite-4.0-H: Mamba-2 (models/mamba2.py) or attention (usually without positions) then
Mixtral's router over SwiGLU experts beside an always-on shared MLP; muP-style scalars on
embeddings, residual branches, attention and logits."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, granitemoe, nemotron_h
from r3srv.models.specs import LinearAttentionSpec


def configure(cfg, raw, get):
    n = cfg.num_layers
    kinds = [nemotron_h.KINDS.get(t, t) for t in (raw.get("layer_types") or raw.get("layers_block_type") or [])]
    if len(kinds) != n or set(kinds) - {"mamba", "attention"}:
        raise ConfigError(f"GraniteMoeHybridForCausalLM: layer_types {kinds} must be {n} of mamba / attention")
    position = raw.get("position_embedding_type") or "nope"
    if position not in ("nope", "rope"):
        raise ConfigError(f"GraniteMoeHybridForCausalLM: position_embedding_type={position!r} is not supported")
    if int(raw.get("mamba_expand", 2)) * get.int("hidden_size") != get.int("mamba_n_heads") * get.int("mamba_d_head"):
        raise ConfigError("GraniteMoeHybridForCausalLM: mamba_expand x hidden_size must be mamba_n_heads x mamba_d_head")
    limit = raw.get("time_step_limit") or [0.0]  # JSON may spell its infinite upper bound as an object
    mamba = LinearAttentionSpec(
        kind="mamba2",
        layers=[i for i, kind in enumerate(kinds) if kind == "mamba"],
        mamba_num_heads=get.int("mamba_n_heads"),
        mamba_head_dim=get.int("mamba_d_head"),
        state_size=get.int("mamba_d_state"),
        groups=get.int("mamba_n_groups", default=1),
        conv_kernel=get.int("mamba_d_conv", default=4),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=float(limit[0] if isinstance(limit[0], (int, float)) else 0.0),
    )
    cfg = granitemoe.with_granite_scalars(cfg, raw)
    return replace(cfg, linear=mamba, rope=replace(cfg.rope, enabled=position == "rope"))


FAMILY = Family("granitemoehybrid", ("GraniteMoeHybridForCausalLM",), configure, granitemoe.weight_targets)
