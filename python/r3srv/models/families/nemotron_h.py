"""Nemotron-H (NVIDIA Nemotron 3 Nano): every layer is one mixer behind one norm (Mamba-2,
attention without positions, MoE or MLP); DeepSeek-V3's router over non-gated relu^2 experts, a
non-gated shared expert. Released checkpoints spell "model." as "backbone."."""

from __future__ import annotations

from dataclasses import replace

from r3srv.errors import ConfigError
from r3srv.models.families import Family
from r3srv.models.specs import ExpertSpec, LinearAttentionSpec, RouterSpec

# layer kinds in transformers 5's names, the older ones and the pattern letters
KINDS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "attention",
         "attention": "attention", "*": "attention", "moe": "moe", "E": "moe", "mlp": "mlp", "-": "mlp"}


def layer_kinds(raw) -> list[str]:
    """Each layer's mixer: layers_block_type / layer_types, else hybrid_override_pattern (M E * -)."""
    listed = raw.get("layers_block_type") or raw.get("layer_types") or list(raw.get("hybrid_override_pattern") or "")
    unknown = sorted({kind for kind in listed if kind not in KINDS})
    if not listed or unknown:
        raise ConfigError(f"NemotronHForCausalLM: layer kinds {unknown or 'missing'}; expected layers_block_type of "
                          "mamba / attention / moe / mlp (or hybrid_override_pattern of M * E -)")
    return [KINDS[kind] for kind in listed]


def configure(cfg, raw, get):
    kinds = layer_kinds(raw)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise ConfigError(f"NemotronHForCausalLM: {key}={raw[key]!r} is not supported (only {want!r})")
    if raw.get("moe_latent_size"):
        raise ConfigError("NemotronHForCausalLM: moe_latent_size (latent MoE projections) is not supported")
    if raw.get("mlp_bias"):
        raise ConfigError("NemotronHForCausalLM: mlp_bias=true is not supported")
    mamba = LinearAttentionSpec(
        kind="mamba2",
        layers=[i for i, kind in enumerate(kinds) if kind == "mamba"],
        mamba_num_heads=get.int("mamba_num_heads"),
        mamba_head_dim=get.int("mamba_head_dim"),
        state_size=get.int("ssm_state_size"),
        groups=get.int("n_groups", "mamba_n_groups", default=8),
        conv_kernel=get.int("conv_kernel", "mamba_d_conv", default=4),
        conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        proj_bias=bool(raw.get("use_bias", False)),
        dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
    )
    return replace(
        cfg,
        num_layers=len(kinds),
        layer_kinds=kinds,
        linear=mamba,
        moe_layers=[i for i, kind in enumerate(kinds) if kind == "moe"],
        norm=replace(cfg.norm, eps=float(raw.get("layer_norm_epsilon", 1e-5)), weight_float32=True),
        rope=replace(cfg.rope, enabled=False),
        moe_intermediate_size=get.int("moe_intermediate_size"),
        experts=ExpertSpec(activation="relu2", shared_gate=False,
                           shared_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size") or 0)),
        router=RouterSpec(scoring="sigmoid", correction_bias=True, float32=True,
                          renormalize=bool(raw.get("norm_topk_prob", True)),
                          scaling=float(raw.get("routed_scaling_factor", 1.0)),
                          num_groups=int(raw.get("n_group") or 1), topk_groups=int(raw.get("topk_group") or 1)),
    )


def mixer_targets(layer, prefix: str) -> dict:
    targets = {prefix + "norm.weight": layer.norm}
    if layer.attn is not None:
        return targets | layer.attn.weight_targets(prefix, module="mixer.")
    if layer.linear_attn is not None:
        return targets | layer.linear_attn.weight_targets(prefix, module="mixer.")
    p, mlp = prefix + "mixer.", layer.mlp
    if not layer.is_moe:
        return targets | {p + "up_proj.weight": mlp.gate_up.part(), p + "down_proj.weight": mlp.down.part()}
    experts = mlp.experts
    targets |= {p + "gate.weight": mlp.gate, p + "gate.e_score_correction_bias": mlp.correction_bias,
                p + "experts.up_proj": experts.w13_part(),
                p + "experts.down_proj": experts.w2_part()}  # transformers 5's fused names
    for e in experts.local_ids:
        targets[p + f"experts.{e}.up_proj.weight"] = experts.w13_part(e)
        targets[p + f"experts.{e}.down_proj.weight"] = experts.w2_part(e)
    if mlp.shared is not None:
        targets[p + "shared_experts.up_proj.weight"] = mlp.shared.gate_up.part()
        targets[p + "shared_experts.down_proj.weight"] = mlp.shared.down.part()
    return targets


def weight_targets(model):
    targets = {} if model.config.tie_word_embeddings else {"lm_head.weight": model.lm_head.part()}
    named = {"model.embeddings.weight": model.embed.part(), "model.norm_f.weight": model.final_norm}
    for layer in model.layers:
        named |= mixer_targets(layer, f"model.layers.{layer.index}.")
    named = {k: v for k, v in named.items() if v is not None}
    return targets | named | {"backbone." + k.removeprefix("model."): v for k, v in named.items()}


FAMILY = Family("nemotron_h", ("NemotronHForCausalLM",), configure, weight_targets,
                count_layers=lambda raw: len(layer_kinds(raw)))  # transformers 5 writes no num_hidden_layers
