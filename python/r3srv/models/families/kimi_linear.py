"""Kimi-Linear: Kimi Delta Attention layers (models/kda.py) and multi-head latent attention
without positions (kda_layers / full_attn_layers of linear_attn_config, 1-indexed, or
layer_types), DeepSeek-V3's router over Mixtral-named experts."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family, deepseek_v3, glm4_moe
from r3srv.models.families._names import MoeNames, decoder_targets, moe_targets
from r3srv.models.families._parsing import mlp_layer_types
from r3srv.models.specs import LinearAttentionSpec

# its config.json spells DeepSeek's keys its own way (transformers' attribute_map)
SPELLINGS = {"num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
             "moe_renormalize": "norm_topk_prob", "num_shared_experts": "n_shared_experts",
             "model_max_length": "max_position_embeddings"}
NAMES = MoeNames(module="block_sparse_moe.", projections=("w1", "w3", "w2"), shared="mlp.shared_experts.",
                 correction_bias=("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"))
DENSE = ("gate_proj", "up_proj", "down_proj")


def layer_types(raw, num_layers: int) -> list[str]:
    linear = raw.get("linear_attn_config") or {}
    types = raw.get("layer_types")
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:
                types[layer - 1] = kind
    if types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"KimiLinearForCausalLM: layer kinds {types} must be {num_layers} of KDA / full attention")
    return types


def configure(cfg, raw, get):
    deepseek_v3.check_router(raw, "KimiLinearForCausalLM")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"KimiLinearForCausalLM: moe_router_activation_func={raw['moe_router_activation_func']!r} "
                          "is not supported (only 'sigmoid')")
    linear = raw.get("linear_attn_config") or {}
    types = layer_types(raw, cfg.num_layers)
    heads = int(linear.get("num_heads") or raw.get("linear_num_heads") or 32)
    dim = int(linear.get("head_dim") or raw.get("linear_head_dim") or 128)
    cfg = deepseek_v3.with_mla(glm4_moe.configure(cfg, raw, get), raw, get, first_dense_default=1)
    return replace(
        cfg,
        moe_layers=mlp_layer_types(raw, cfg.num_layers, "KimiLinearForCausalLM", cfg.moe_layers),
        rope=replace(cfg.rope, enabled=False),
        linear=LinearAttentionSpec(
            kind="kda", layers=[i for i, t in enumerate(types) if t == "linear_attention"],
            num_key_heads=heads, num_value_heads=heads, key_head_dim=dim, value_head_dim=dim,
            conv_kernel=int(linear.get("short_conv_kernel_size") or raw.get("linear_conv_kernel_dim") or 4)),
    )


def kimi_moe_targets(p, mlp):
    """Its shared experts are released under block_sparse_moe like its experts."""
    targets = moe_targets(p, mlp, NAMES)
    shared = p + NAMES.shared
    return targets | {k.replace(".mlp.", ".block_sparse_moe.", 1): v for k, v in targets.items() if k.startswith(shared)}


def weight_targets(model):
    targets = decoder_targets(model, kimi_moe_targets)
    for layer in model.layers:  # transformers writes its dense MLPs as block_sparse_moe
        if not layer.is_moe:
            p = f"model.layers.{layer.index}."
            targets |= {p + f"block_sparse_moe.{name}.weight": targets[p + f"mlp.{name}.weight"] for name in DENSE}
    return targets


FAMILY = Family("kimi_linear", ("KimiLinearForCausalLM",), configure, weight_targets, spellings=SPELLINGS)
