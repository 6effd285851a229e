"""Each family's switches of ModelConfig, read from its raw config.json (see models/config.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from r3srv.errors import ConfigError

if TYPE_CHECKING:
    from r3srv.models.config import _Getter


# Kimi-Linear's config.json spells DeepSeek's keys its own way (transformers' attribute_map)
_KIMI_SPELLINGS = {"num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
                   "moe_renormalize": "norm_topk_prob", "num_shared_experts": "n_shared_experts",
                   "model_max_length": "max_position_embeddings"}


# LFM2's config.json spellings (older releases: tie_embedding)
_LFM2_SPELLINGS = {"norm_eps": "rms_norm_eps", "tie_embedding": "tie_word_embeddings"}


def standard_spellings(family: str, raw: dict[str, Any]) -> dict[str, Any]:
    """raw with a family's own spellings of common keys added under the common names."""
    spellings = {"kimi_linear": _KIMI_SPELLINGS, "lfm2_moe": _LFM2_SPELLINGS}.get(family)
    if spellings is None:
        return raw
    return {**{common: raw[own] for own, common in spellings.items() if own in raw}, **raw}


def family_switches(
    family: str, raw: dict[str, Any], get: "_Getter", *, num_layers: int, head_dim: int, num_experts: int
) -> dict[str, Any]:
    """The ModelConfig fields in which `family` departs from the defaults."""
    if family in ("qwen3_moe", "qwen2_moe"):
        switches: dict[str, Any] = dict(
            moe_intermediate_size=get.int("moe_intermediate_size"),
            moe_layers=_qwen_moe_layers(raw, num_layers, num_experts),
            renormalize=bool(raw.get("norm_topk_prob", False)),  # the HF default
        )
        windowed = bool(raw.get("use_sliding_window")) and bool(raw.get("sliding_window"))
        if family == "qwen3_moe":  # transformers windows every layer when use_sliding_window
            bias = bool(raw.get("attention_bias", False))
            windows = [int(raw["sliding_window"])] * num_layers if windowed else None
            return switches | dict(qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_windows=windows)
        # Qwen2-MoE: layer_types, else transformers' rule (even layers below max_window_layers)
        start = num_layers if raw.get("max_window_layers") is None else int(raw["max_window_layers"])
        rule = ["sliding_attention" if windowed and i % 2 == 0 and i < start else "full_attention" for i in range(num_layers)]
        return switches | dict(
            qkv_bias=bool(raw.get("qkv_bias", True)),  # older configs have no key: always biased
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            sliding_windows=_layer_windows(raw if windowed else {**raw, "layer_types": None}, num_layers,
                                           "Qwen2MoeForCausalLM", default=rule),
        )
    if family == "qwen3_vl_moe":
        # Qwen3-VL's language model: Qwen3-MoE's attention and layout, a router that always
        # renormalises; text prompts (its M-RoPE is plain RoPE for text, all three ids equal)
        bias = bool(raw.get("attention_bias", False))
        return dict(moe_intermediate_size=get.int("moe_intermediate_size"),
                    moe_layers=_qwen_moe_layers(raw, num_layers, num_experts), renormalize=True,
                    qkv_bias=bias, o_bias=bias, qk_norm="head")
    if family == "mixtral":  # a sliding_window applies to every layer
        window = raw.get("sliding_window")
        return dict(renormalize=True, sliding_windows=[int(window)] * num_layers if window else None)
    if family in ("olmoe", "flex_olmo"):
        bias = bool(raw.get("attention_bias", False))
        switches = dict(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=raw.get("clip_qkv"),
                        renormalize=bool(raw.get("norm_topk_prob", False)))
        if family == "flex_olmo":  # OLMoE's router and attention in OLMo-2's layout: each branch's output normalised
            switches |= dict(pre_norms=False, sandwich_norms=True)
        return switches
    if family == "glm4_moe":
        return _glm4_moe_switches(raw, get, num_layers)
    if family == "minimax_m2":
        return _minimax_m2_switches(raw, head_dim)
    if family == "deepseek_v3":
        _check_v3_router(raw)
        # GLM-4.5's router and MoE layout, with multi-head latent attention
        return _glm4_moe_switches(raw, get, num_layers) | _mla_switches(raw, get, first_dense_default=3)
    if family == "glm4_moe_lite":
        # GLM-4.7-Flash: DeepSeek-V3's attention and GLM-4.5's router; dense layers by mlp_layer_types
        switches = _glm4_moe_switches(raw, get, num_layers) | _mla_switches(raw, get, first_dense_default=1)
        return _mlp_layer_types(raw, num_layers, "Glm4MoeLiteForCausalLM", switches)
    if family in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek-V3.2 and GLM-5: DeepSeek-V3 with sparse attention (always interleaved MLA rotary)
        architecture = "DeepseekV32ForCausalLM" if family == "deepseek_v32" else "GlmMoeDsaForCausalLM"
        _check_v3_router(raw, architecture)
        switches = _glm4_moe_switches(raw, get, num_layers) | _mla_switches(raw, get, first_dense_default=3)
        switches = _mlp_layer_types(raw, num_layers, architecture, switches)
        return switches | dict(rope_interleave=True) | _dsa_switches(raw, get, num_layers, family, architecture)
    if family == "deepseek_v2":
        return _deepseek_v2_switches(raw, get) | _mla_switches(raw, get, first_dense_default=0)
    if family == "gpt_oss":
        return _gpt_oss_switches(raw, num_layers)
    if family == "ernie4_5_moe":
        return _ernie4_5_moe_switches(raw, get, num_layers)
    if family == "dots1":
        # dots.llm1: DeepSeek-V3's router and MoE layout under Qwen3's attention
        bias = bool(raw.get("attention_bias", False))
        return _glm4_moe_switches(raw, get, num_layers) | dict(
            moe_layers=list(range(min(int(raw.get("first_k_dense_replace", 0)), num_layers), num_layers)),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            partial_rotary_factor=1.0, qk_norm="head", qkv_bias=bias, o_bias=bias,
            sliding_windows=_layer_windows(raw, num_layers, "Dots1ForCausalLM"),
        )
    if family in ("qwen3_next", "qwen3_5_moe"):
        return _qwen_hybrid_switches(family, raw, get, num_layers, num_experts)
    if family == "nemotron_h":
        return _nemotron_h_switches(raw, get)
    if family == "kimi_linear":
        return _kimi_linear_switches(raw, get, num_layers)
    if family == "granitemoehybrid":
        return _granite_hybrid_switches(raw, get, num_layers)
    if family in ("granitemoe", "granitemoeshared"):
        return _granite_switches(raw)
    if family == "granitemoe_swa":
        return _granite_swa_switches(raw, num_layers)
    if family == "lfm2_moe":
        return _lfm2_moe_switches(raw, get, num_layers)
    if family == "afmoe":
        return _afmoe_switches(raw, get, num_layers)
    raise ValueError(f"no switches for family {family!r}")


# Nemotron-H's layer kinds, in transformers 5's names, the older ones and the pattern letters
_NEMOTRON_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "attention",
                   "attention": "attention", "*": "attention", "moe": "moe", "E": "moe", "mlp": "mlp", "-": "mlp"}


def nemotron_h_layer_kinds(raw: dict[str, Any]) -> list[str]:
    """Each layer's mixer: layers_block_type / layer_types, else hybrid_override_pattern (M E * -)."""
    listed = raw.get("layers_block_type") or raw.get("layer_types") or list(raw.get("hybrid_override_pattern") or "")
    unknown = sorted({kind for kind in listed if kind not in _NEMOTRON_KINDS})
    if not listed or unknown:
        raise ConfigError(f"NemotronHForCausalLM: layer kinds {unknown or 'missing'}; expected layers_block_type of "
                          "mamba / attention / moe / mlp (or hybrid_override_pattern of M * E -)")
    return [_NEMOTRON_KINDS[kind] for kind in listed]


def _nemotron_h_switches(raw: dict[str, Any], get: "_Getter") -> dict[str, Any]:
    """Nemotron-H: Mamba-2, attention (no positions), MoE and MLP layers, each one mixer behind a
    norm; DeepSeek-V3's router over non-gated relu^2 experts, a non-gated shared expert."""
    kinds = nemotron_h_layer_kinds(raw)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise ConfigError(f"NemotronHForCausalLM: {key}={raw[key]!r} is not supported (only {want!r})")
    if raw.get("moe_latent_size"):
        raise ConfigError("NemotronHForCausalLM: moe_latent_size (latent MoE projections) is not supported")
    if raw.get("mlp_bias"):
        raise ConfigError("NemotronHForCausalLM: mlp_bias=true is not supported")
    return dict(
        num_layers=len(kinds),
        layer_kinds=kinds,
        norm_weight_float32=True,
        linear_attention_layers=[i for i, kind in enumerate(kinds) if kind == "mamba"],
        moe_layers=[i for i, kind in enumerate(kinds) if kind == "moe"],
        mamba_num_heads=get.int("mamba_num_heads"),
        mamba_head_dim=get.int("mamba_head_dim"),
        mamba_state_size=get.int("ssm_state_size"),
        mamba_groups=get.int("n_groups", "mamba_n_groups", default=8),
        mamba_conv_kernel=get.int("conv_kernel", "mamba_d_conv", default=4),
        mamba_conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        mamba_proj_bias=bool(raw.get("use_bias", False)),
        mamba_dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
        use_rope=False,
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        moe_intermediate_size=get.int("moe_intermediate_size"),
        shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size") or 0),
        shared_expert_gate=False,
        expert_activation="relu2",
        scoring="sigmoid",
        router_bias=True,
        router_float32=True,
        renormalize=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_expert_groups=int(raw.get("n_group") or 1),
        topk_expert_groups=int(raw.get("topk_group") or 1),
    )


def _afmoe_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """Arcee's AFMoE (Trinity): sliding-window layers with RoPE and full-attention layers
    without, a sigmoid gate projection on the attention output, per-head q/k norms, norms
    before and after each branch, a sigmoid router with an expert bias, shared experts."""
    every = int(raw.get("global_attn_every_n_layers") or 4)
    default = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]
    windows = _layer_windows(raw, num_layers, "AfmoeForCausalLM", default=default)
    moe_width = get.int("moe_intermediate_size")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        moe_intermediate_size=moe_width,
        moe_layers=list(range(min(int(raw.get("num_dense_layers") or 0), num_layers), num_layers)),
        qk_norm="head", qkv_bias=bias, o_bias=bias,
        sliding_windows=windows,
        rope_layers=[i for i in range(num_layers) if windows is not None and windows[i] is not None],
        attention_gate_proj=True,
        sandwich_norms=True,
        norm_weight_float32=True,
        scoring="sigmoid", router_bias=True, router_float32=True, renormalize=True,
        routed_scaling_factor=float(raw.get("route_scale") or 1.0),
        shared_expert_intermediate_size=moe_width * int(raw.get("num_shared_experts") or 0),
        shared_expert_gate=False,
        embedding_multiplier=get.int("hidden_size") ** 0.5 if raw.get("mup_enabled") else 1.0,
    )


def _lfm2_moe_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """LFM2-MoE: gated short convolutions (layer_types "conv") beside attention with per-head
    q/k norms; after num_dense_layers dense MLPs, a sigmoid router whose expert bias only picks
    (DeepSeek-V3's scheme without groups)."""
    types = raw.get("layer_types") or []
    if len(types) != num_layers or set(types) - {"conv", "full_attention"}:
        raise ConfigError(f"Lfm2MoeForCausalLM: layer_types {types} must be {num_layers} of conv / full_attention")
    return dict(
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=list(range(min(int(raw.get("num_dense_layers") or 0), num_layers), num_layers)),
        linear_attention_kind="short_conv",
        linear_attention_layers=[i for i, kind in enumerate(types) if kind == "conv"],
        linear_conv_kernel_dim=get.int("conv_L_cache", default=3),
        short_conv_bias=bool(raw.get("conv_bias", False)),
        qk_norm="head",
        scoring="sigmoid",
        router_bias=bool(raw.get("use_expert_bias", True)),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )


def _granite_switches(raw: dict[str, Any]) -> dict[str, Any]:
    """Granite 3.x MoE (GraniteMoe) and GraniteMoeShared: attention with RoPE then Mixtral's
    router (a softmax over the top-k logits) over SwiGLU experts, beside an always-on shared MLP
    where shared_intermediate_size says; muP-style scalars on embeddings, residual branches,
    attention and logits (transformers' defaults: 1.0 each)."""
    bias = bool(raw.get("attention_bias", False))
    return dict(
        renormalize=True,
        qkv_bias=bias, o_bias=bias,
        shared_expert_intermediate_size=int(raw.get("shared_intermediate_size") or 0),
        shared_expert_gate=False,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),
    )


def _granite_swa_switches(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GraniteMoeSWA (granite-swash): GraniteMoeShared with sliding-window layers (by default
    every fourth layer, from the first, attends fully), a learned per-head sink in every
    layer (transformers scales the output by sigmoid(lse - sink): the sink logit in the
    softmax's denominator, gpt-oss's form), and a RoPE base per layer where 0 means no
    positions. One base for all rotary layers is supported; several are refused."""
    default = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    windows = _layer_windows({"sliding_window": 128, **raw}, num_layers, "GraniteMoeSWAForCausalLM", default=default)
    switches = _granite_switches(raw) | dict(attention_sinks=True, sliding_windows=windows)
    thetas = raw.get("layer_rope_theta")
    if thetas is not None:
        if len(thetas) != num_layers:
            raise ConfigError(f"GraniteMoeSWAForCausalLM: layer_rope_theta has {len(thetas)} entries for {num_layers} layers")
        bases = sorted({float(t) for t in thetas if t})
        if len(bases) > 1:
            raise ConfigError(f"GraniteMoeSWAForCausalLM: layer_rope_theta uses several RoPE bases {bases}; "
                              "only one (besides 0, no positions) is supported")
        switches |= dict(rope_layers=[i for i, t in enumerate(thetas) if t])
        if bases:
            switches |= dict(rope_theta=bases[0])
    return switches


def _granite_hybrid_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """Granite-4.0-H: Mamba-2 or attention (usually without positions) then Mixtral's router
    over SwiGLU experts beside an always-on shared MLP; muP-style scalars on embeddings,
    residual branches, attention and logits."""
    kinds = [_NEMOTRON_KINDS.get(t, t) for t in (raw.get("layer_types") or raw.get("layers_block_type") or [])]
    if len(kinds) != num_layers or set(kinds) - {"mamba", "attention"}:
        raise ConfigError(f"GraniteMoeHybridForCausalLM: layer_types {kinds} must be {num_layers} of mamba / attention")
    position = raw.get("position_embedding_type") or "nope"
    if position not in ("nope", "rope"):
        raise ConfigError(f"GraniteMoeHybridForCausalLM: position_embedding_type={position!r} is not supported")
    hidden = get.int("hidden_size")
    if int(raw.get("mamba_expand", 2)) * hidden != get.int("mamba_n_heads") * get.int("mamba_d_head"):
        raise ConfigError("GraniteMoeHybridForCausalLM: mamba_expand x hidden_size must be mamba_n_heads x mamba_d_head")
    limit = raw.get("time_step_limit") or [0.0]  # JSON may spell its infinite upper bound as an object
    return dict(
        linear_attention_kind="mamba2",
        linear_attention_layers=[i for i, kind in enumerate(kinds) if kind == "mamba"],
        mamba_num_heads=get.int("mamba_n_heads"),
        mamba_head_dim=get.int("mamba_d_head"),
        mamba_state_size=get.int("mamba_d_state"),
        mamba_groups=get.int("mamba_n_groups", default=1),
        mamba_conv_kernel=get.int("mamba_d_conv", default=4),
        mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        mamba_dt_min=float(limit[0] if isinstance(limit[0], (int, float)) else 0.0),
        use_rope=position == "rope",
        renormalize=True,  # a softmax over the top-k logits
        shared_expert_intermediate_size=int(raw.get("shared_intermediate_size") or 0),
        shared_expert_gate=False,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),  # transformers' default, as GraniteMoe's
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
    )


def _kimi_linear_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """Kimi-Linear: Kimi Delta Attention layers and multi-head latent attention without positions
    (kda_layers / full_attn_layers of linear_attn_config, 1-indexed, or layer_types), DeepSeek-V3's
    router over Mixtral-named experts."""
    _check_v3_router(raw, "KimiLinearForCausalLM")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"KimiLinearForCausalLM: moe_router_activation_func={raw['moe_router_activation_func']!r} "
                          "is not supported (only 'sigmoid')")
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
    heads = int(linear.get("num_heads") or raw.get("linear_num_heads") or 32)
    dim = int(linear.get("head_dim") or raw.get("linear_head_dim") or 128)
    switches = _glm4_moe_switches(raw, get, num_layers) | _mla_switches(raw, get, first_dense_default=1)
    switches = _mlp_layer_types(raw, num_layers, "KimiLinearForCausalLM", switches)
    return switches | dict(
        use_rope=False,
        linear_attention_kind="kda",
        linear_attention_layers=[i for i, t in enumerate(types) if t == "linear_attention"],
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim, linear_value_head_dim=dim,
        linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size") or raw.get("linear_conv_kernel_dim") or 4),
    )


def _qwen_hybrid_switches(family: str, raw: dict[str, Any], get: "_Getter", num_layers: int, num_experts: int):
    """Qwen3-Next and Qwen3.5 MoE: Gated DeltaNet layers with a gated full-attention layer every
    full_attention_interval (layer_types), zero-centred norms, Qwen2-MoE's gated shared expert.
    Qwen3.5 is multimodal: its text_config is served (text prompts; its M-RoPE is plain RoPE
    for text, where all three position ids are equal)."""
    architecture = "Qwen3NextForCausalLM" if family == "qwen3_next" else "Qwen3_5MoeForConditionalGeneration"
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"{architecture}: layer_types {types} must be {num_layers} of linear_attention / full_attention")
    rope = raw.get("rope_parameters") or {}
    bias = bool(raw.get("attention_bias", False))
    switches = dict(
        moe_intermediate_size=get.int("moe_intermediate_size"),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        qk_norm="head", qkv_bias=bias, o_bias=bias,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))),
        attention_output_gate=bool(raw.get("attn_output_gate", True)),  # Qwen3.5 spells it out
        zero_centered_norms=True,
        linear_attention_layers=[i for i, t in enumerate(types) if t == "linear_attention"],
        linear_num_key_heads=get.int("linear_num_key_heads"),
        linear_num_value_heads=get.int("linear_num_value_heads"),
        linear_key_head_dim=get.int("linear_key_head_dim"),
        linear_value_head_dim=get.int("linear_value_head_dim"),
        linear_conv_kernel_dim=get.int("linear_conv_kernel_dim", default=4),
    )
    if switches["linear_num_value_heads"] % switches["linear_num_key_heads"]:
        raise ConfigError(f"{architecture}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if family == "qwen3_next":
        return switches | dict(moe_layers=_qwen_moe_layers(raw, num_layers, num_experts),
                               renormalize=bool(raw.get("norm_topk_prob", True)))
    # Qwen3.5: every layer MoE, always renormalised
    return switches | dict(moe_layers=list(range(num_layers)), renormalize=True, linear_projection_layout="qkv_z_b_a")


def _glm4_moe_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """GLM-4.5 / 4.6 (Glm4MoeForCausalLM): sigmoid router with a correction bias, optional
    expert groups and scaling, gate-less shared experts, dense first layers, partial RoPE."""
    moe_width = get.int("moe_intermediate_size")
    rope = raw.get("rope_parameters") or {}
    first_dense = int(raw.get("first_k_dense_replace", 1))  # the transformers default
    return dict(
        moe_intermediate_size=moe_width,
        moe_layers=list(range(min(first_dense, num_layers), num_layers)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        qk_norm="head" if raw.get("use_qk_norm") else None,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))),
        renormalize=bool(raw.get("norm_topk_prob", True)),
        scoring="sigmoid",
        router_bias=True,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_expert_groups=int(raw.get("n_group") or 1),
        topk_expert_groups=int(raw.get("topk_group") or 1),
        router_float32=True,
        shared_expert_intermediate_size=moe_width * int(raw.get("n_shared_experts") or 0),
        shared_expert_gate=False,
    )


def _check_v3_router(raw: dict[str, Any], architecture: str = "DeepseekV3ForCausalLM") -> None:
    if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(
            f"{architecture}: scoring_func={raw.get('scoring_func')!r} / topk_method={raw.get('topk_method')!r} "
            "is not supported (only DeepSeek-V3's sigmoid / noaux_tc router)"
        )


def _mlp_layer_types(raw: dict[str, Any], num_layers: int, architecture: str, switches: dict[str, Any]):
    """Dense and MoE layers by mlp_layer_types (dense / sparse) when the config lists them."""
    kinds = raw.get("mlp_layer_types")
    if kinds is not None:
        if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
            raise ConfigError(f"{architecture}: mlp_layer_types {kinds} must be {num_layers} of dense / sparse")
        switches["moe_layers"] = [i for i, kind in enumerate(kinds) if kind == "sparse"]
    return switches


def _dsa_switches(raw: dict[str, Any], get: "_Getter", num_layers: int, family: str, architecture: str):
    """The sparse-attention indexer: DeepSeek-V3.2 rotates its index keys by halves, GLM-5
    interleaved, and GLM-5's "shared" layers (indexer_types, or transformers' pattern /
    frequency rule) reuse the last full layer's selection."""
    types = raw.get("indexer_types")
    if types is None and family == "glm_moe_dsa":
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        else:
            freq = max(int(raw.get("index_topk_freq") or 1), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = types or ["full"] * num_layers
    if len(types) != num_layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise ConfigError(f"{architecture}: indexer_types {types} must be {num_layers} of full / shared, the first full")
    if raw.get("q_lora_rank") in (None, 0):
        raise ConfigError(f"{architecture}: sparse attention needs q_lora_rank (its indexer reads the low-rank query)")
    return dict(
        index_topk=get.int("index_topk"),
        index_n_heads=get.int("index_n_heads"),
        index_head_dim=get.int("index_head_dim"),
        index_rope_interleave=family == "glm_moe_dsa",
        index_shared_layers=[i for i, t in enumerate(types) if t == "shared"],
    )


def _deepseek_v2_switches(raw: dict[str, Any], get: "_Getter") -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite: softmax router, greedy or group_limited_greedy (a group scores
    its best expert), no renormalisation unless norm_topk_prob, gate-less shared experts."""
    method = raw.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy") or raw.get("scoring_func", "softmax") != "softmax":
        raise ConfigError(
            f"DeepseekV2ForCausalLM: topk_method={method!r} / scoring_func={raw.get('scoring_func')!r} is not "
            "supported (only softmax with 'greedy' or 'group_limited_greedy')"
        )
    if raw.get("mlp_bias"):
        raise ConfigError("DeepseekV2ForCausalLM: mlp_bias=true is not supported")
    grouped = method == "group_limited_greedy"
    moe_width = get.int("moe_intermediate_size")
    return dict(
        moe_intermediate_size=moe_width,
        renormalize=bool(raw.get("norm_topk_prob", False)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_expert_groups=int(raw.get("n_group") or 1) if grouped else 1,
        topk_expert_groups=int(raw.get("topk_group") or 1) if grouped else 1,
        group_score_top=1,
        router_float32=True,  # the references compute these logits in float32
        shared_expert_intermediate_size=moe_width * int(raw.get("n_shared_experts") or 0),
        shared_expert_gate=False,
    )


def _mla_switches(raw: dict[str, Any], get: "_Getter", first_dense_default: int) -> dict[str, Any]:
    """DeepSeek-V2/V3's multi-head latent attention (Kimi-K2 and Moonlight share V3's architecture)."""
    rope_dim = get.int("qk_rope_head_dim")
    layers = get.int("num_hidden_layers")
    first_dense = int(raw.get("first_k_dense_replace", first_dense_default))
    every = int(raw.get("moe_layer_freq") or 1)
    return dict(
        kv_lora_rank=get.int("kv_lora_rank"),
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        qk_nope_head_dim=get.int("qk_nope_head_dim"),
        v_head_dim=get.int("v_head_dim"),
        head_dim=rope_dim,
        num_kv_heads=get.int("num_attention_heads"),  # the latent expands to every head
        partial_rotary_factor=1.0,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm=None,
        # the DeepSeek references: dense before first_k_dense_replace, then every moe_layer_freq-th
        moe_layers=[i for i in range(first_dense, layers) if i % every == 0],
    )


def _minimax_m2_switches(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """MiniMax-M2 (MiniMaxM2ForCausalLM): Mixtral's layout and names with a sigmoid router and a
    correction bias (always renormalised), q/k RMSNorm over all heads, partial RoPE."""
    rope = raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor")
    if factor is None:  # released configs give `rotary_dim` (64 of head_dim 128)
        factor = raw["rotary_dim"] / head_dim if raw.get("rotary_dim") else raw.get("partial_rotary_factor", 1.0)
    if raw.get("shared_intermediate_size"):
        raise ConfigError("MiniMaxM2ForCausalLM: shared experts (shared_intermediate_size > 0) are not supported")
    return dict(
        qk_norm="full",
        partial_rotary_factor=float(factor),
        renormalize=True,
        scoring="sigmoid",
        router_bias=True,
        # float32 router logits: bf16 rounding kept out of which experts win, as for GLM-4.5
        router_float32=True,
    )


def _layer_windows(raw: dict[str, Any], num_layers: int, architecture: str, default: list[str] | None = None):
    """Per-layer sliding windows (None: full attention) from layer_types and sliding_window;
    None when no layer is windowed. Without layer_types: `default`, else Qwen2's rule
    (layers from max_window_layers on are windowed when sliding_window is set)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or default
    if types is None:
        start = num_layers if raw.get("max_window_layers") is None else int(raw["max_window_layers"])
        types = ["sliding_attention" if window and i >= start else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != num_layers or unknown or ("sliding_attention" in types and not window):
        raise ConfigError(f"{architecture}: layer_types {types} / sliding_window {window!r} do not describe "
                          f"{num_layers} full or sliding attention layers")
    if "sliding_attention" not in types:
        return None
    return [int(window) if t == "sliding_attention" else None for t in types]


def _gpt_oss_switches(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: biased attention with sinks, sliding-window layers (layer_types), a biased
    router whose top-k logits are softmaxed, biased experts with a clamped SwiGLU."""
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return dict(
        qkv_bias=bool(raw.get("attention_bias", True)),
        o_bias=bool(raw.get("attention_bias", True)),
        attention_sinks=True,
        sliding_windows=_layer_windows(raw, num_layers, "GptOssForCausalLM", default=alternating),
        renormalize=True,  # softmax over the top-k logits = the top-k softmax scores renormalised
        router_logit_bias=True,
        expert_activation="gpt_oss",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


def _ernie4_5_moe_switches(raw: dict[str, Any], get: "_Getter", num_layers: int) -> dict[str, Any]:
    """ERNIE-4.5 MoE: float32 softmax router whose correction bias (moe_statics) steers the
    choice, gate-less shared experts, MoE layers by start / end / interval, GPT-J-style RoPE."""
    if raw.get("use_bias"):
        raise ConfigError("Ernie4_5_MoeForCausalLM: use_bias=true is not supported")
    moe_width = get.int("moe_intermediate_size")
    start, every = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_interval") or 1)
    end = int(raw.get("moe_layer_end_index", -1))
    end = num_layers - 1 if end == -1 else end
    return dict(
        moe_intermediate_size=moe_width,
        moe_layers=[i for i in range(num_layers) if (i + 1) % every == 0 and start <= i <= end],
        renormalize=True,
        router_bias=True,
        router_float32=True,
        rope_interleave=True,
        shared_expert_intermediate_size=moe_width * int(raw.get("moe_num_shared_experts") or 0),
        shared_expert_gate=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _qwen_moe_layers(raw: dict[str, Any], num_layers: int, num_experts: int) -> list[int]:
    """Qwen MoE layer rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    if num_experts <= 0:
        return []
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
