"""ModelConfig: one flat description of an MoE decoder, parsed from a raw Hugging Face config.json.

The ten families differ in a handful of switches (q/k norm width, qkv clipping, partial
rotary, router scoring / bias / groups / renormalisation / scaling, shared expert, which
layers are MoE). Parsing them here, from the raw JSON,
keeps `transformers` out of the runtime and accepts both old and new key spellings.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from r3srv.errors import ConfigError
from r3srv.models.quantization import parse_quantization

logger = logging.getLogger(__name__)

# architecture name (config.json "architectures"[0]) -> family
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "GptOssForCausalLM": "gpt_oss",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_FAMILIES)
_MODEL_TYPE_ARCHITECTURES = {family: arch for arch, family in ARCHITECTURE_FAMILIES.items()}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: Any, *, what: str = "dtype") -> torch.dtype:
    """A torch dtype from a torch.dtype or its name ("bfloat16", "torch.float16", ...)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"unsupported {what} {value!r}; expected one of {sorted(set(_DTYPES))}")


@dataclass
class ModelConfig:
    """Everything the decoder, the loader and the engine need to know about a checkpoint."""

    architecture: str
    model_type: str  # the family: qwen3_moe | qwen2_moe | mixtral | olmoe | glm4_moe | minimax_m2 | deepseek_v3 | deepseek_v2 | gpt_oss | ernie4_5_moe
    name: str  # served model name
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_layers: list[int]  # decoder layers with a sparse MoE block; the others have a dense MLP
    intermediate_size: int  # dense MLP width (dense layers; Mixtral/OLMoE: the expert width)
    moe_intermediate_size: int  # width of one routed expert
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: torch.dtype  # the checkpoint's dtype
    # quantized checkpoints, dequantized at load (models/quantization.py)
    fp8_block: tuple[int, int] | None = None  # block FP8's weight_block_size
    mxfp4: bool = False  # MXFP4 X_blocks / X_scales (gpt-oss)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # "linear" RoPE scaling divides positions by this
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims (GLM-4.5: 0.5)
    # YaRN RoPE scaling (rope_type "yarn"): factor, original_max_position_embeddings, beta_fast,
    # beta_slow, mscale, mscale_all_dim, attention_factor, truncate, as in config.json
    rope_yarn: dict[str, Any] | None = None
    # Multi-head latent attention (DeepSeek-V3): K/V cached as one latent of kv_lora_rank +
    # qk_rope_head_dim per token; head_dim is then qk_rope_head_dim (the rotary width).
    kv_lora_rank: int = 0  # > 0: MLA
    q_lora_rank: int = 0  # > 0: q through a low-rank pair (q_a_proj, q_a_layernorm, q_b_proj)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # attention switches
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    sliding_windows: list[int | None] | None = None  # per layer: keys within this many positions (gpt-oss)
    # router switches
    renormalize: bool = True  # top-k weights renormalised to sum to one
    scoring: str = "softmax"  # "sigmoid": GLM-4.5 / DeepSeek-V3-style routers
    router_bias: bool = False  # e_score_correction_bias: added to the scores for the choice only
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    num_expert_groups: int = 1  # > 1: group-limited routing (n_group / topk_group)
    topk_expert_groups: int = 1
    group_score_top: int = 2  # a group scores the sum of its best this many (DeepSeek-V2: 1)
    router_float32: bool = False  # router matmul in float32 whatever the model dtype (GLM-4.5's reference)
    shared_expert_intermediate_size: int = 0  # > 0: a shared expert every token goes through
    shared_expert_gate: bool = True  # Qwen2-MoE scales it by a sigmoid gate; GLM-4.5's has none
    router_logit_bias: bool = False  # the router linear has a bias (gpt-oss): part of the logits
    # expert MLPs: "silu" (silu(gate) * up, gate rows then up rows) or "gpt_oss" (interleaved
    # gate/up rows, clamped at swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1), biases)
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def is_random_builtin(self) -> bool:
        return bool(self.raw.get("r3srv_random_weights"))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Parse `path/config.json` (and `generation_config.json` for extra EOS ids)."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} is not a model checkpoint directory: {config_file} does not exist")
        try:
            raw = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {config_file}: {exc}") from exc
        generation: dict[str, Any] = {}
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                generation = json.loads(gen_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                generation = {}  # optional file; a broken one only loses extra EOS ids
        return cls.from_dict(raw, name=raw.get("r3srv_model_name") or path.resolve().name, generation=generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "model", generation: dict[str, Any] | None = None) -> "ModelConfig":
        architecture = _architecture(raw)
        family = ARCHITECTURE_FAMILIES[architecture]
        get = _Getter(raw, architecture)

        hidden = get.int("hidden_size")
        heads = get.int("num_attention_heads")
        kv_heads = get.int("num_key_value_heads", default=heads)
        head_dim = raw.get("head_dim") or hidden // heads
        num_layers = get.int("num_hidden_layers")
        num_experts = get.int("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
        top_k = get.int("num_experts_per_tok", "moe_k")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"{architecture}: num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")

        rope_theta, rope_factor, rope_yarn = _rope(raw, architecture)
        fp8_block, mxfp4 = parse_quantization(raw, architecture)
        cfg = dict(
            architecture=architecture,
            model_type=family,
            name=name,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            num_experts=num_experts,
            top_k=top_k,
            moe_layers=list(range(num_layers)),
            intermediate_size=get.int("intermediate_size"),
            moe_intermediate_size=get.int("intermediate_size"),
            max_position_embeddings=get.int("max_position_embeddings", default=4096),
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32", what="checkpoint dtype"),
            fp8_block=fp8_block,
            mxfp4=mxfp4,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling_factor=rope_factor,
            rope_yarn=rope_yarn,
            hidden_act=raw.get("hidden_act", "silu"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            raw=raw,
        )
        if family in ("qwen3_moe", "qwen2_moe"):
            cfg["moe_intermediate_size"] = get.int("moe_intermediate_size")
            cfg["moe_layers"] = _qwen_moe_layers(raw, num_layers, num_experts)
            cfg["renormalize"] = bool(raw.get("norm_topk_prob", False))  # the HF default
        if family == "qwen3_moe":
            cfg["qkv_bias"] = cfg["o_bias"] = bool(raw.get("attention_bias", False))
            cfg["qk_norm"] = "head"
        elif family == "qwen2_moe":
            cfg["qkv_bias"] = bool(raw.get("qkv_bias", True))  # older configs have no key: always biased
            cfg["shared_expert_intermediate_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
        elif family == "mixtral":
            cfg["renormalize"] = True
        elif family == "olmoe":
            cfg["qkv_bias"] = cfg["o_bias"] = bool(raw.get("attention_bias", False))
            cfg["qk_norm"] = "full"
            cfg["clip_qkv"] = raw.get("clip_qkv")
            cfg["renormalize"] = bool(raw.get("norm_topk_prob", False))
        elif family == "glm4_moe":
            cfg.update(_glm4_moe_switches(raw, get, num_layers))
        elif family == "minimax_m2":
            cfg.update(_minimax_m2_switches(raw, int(head_dim)))
        elif family == "deepseek_v3":
            _check_v3_router(raw)
            cfg.update(_glm4_moe_switches(raw, get, num_layers))  # the same router and MoE layout
            cfg.update(_mla_switches(raw, get, first_dense_default=3))
        elif family == "deepseek_v2":
            cfg.update(_deepseek_v2_switches(raw, get))
            cfg.update(_mla_switches(raw, get, first_dense_default=0))
        elif family == "gpt_oss":
            cfg.update(_gpt_oss_switches(raw, num_layers))
        elif family == "ernie4_5_moe":
            cfg.update(_ernie4_5_moe_switches(raw, get, num_layers))
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        if family == "gpt_oss":
            window = None  # its windowed layers run windowed (sliding_windows)
        if window and window < cfg["max_position_embeddings"]:
            # Within the window, sliding-window attention is full attention: capping the
            # length keeps every sequence exact without a windowed kernel.
            logger.warning("%s: sliding_window=%d; capping max_position_embeddings %d to it",
                           architecture, window, cfg["max_position_embeddings"])
            cfg["max_position_embeddings"] = int(window)
        if cfg["hidden_act"] != "silu":
            raise ConfigError(f"{architecture}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        if heads % kv_heads:
            raise ConfigError(f"{architecture}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        _check_routing(architecture, cfg)
        rotary = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
        if rotary < 2 or rotary % 2 or rotary > cfg["head_dim"]:
            raise ConfigError(f"{architecture}: the rotary dims ({rotary}) must be even and in 2..head_dim={cfg['head_dim']}")
        return cls(**cfg)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        if self.is_mla:  # one latent per token, no per-head K/V
            return self.num_layers * block_size * (self.kv_lora_rank + self.head_dim) * dtype.itemsize
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


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


def _check_v3_router(raw: dict[str, Any]) -> None:
    if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(
            f"DeepseekV3ForCausalLM: scoring_func={raw.get('scoring_func')!r} / topk_method={raw.get('topk_method')!r} "
            "is not supported (only DeepSeek-V3's sigmoid / noaux_tc router)"
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
        # float32 router logits, as vLLM and SGLang compute them for this family
        router_float32=True,
    )


def _gpt_oss_switches(raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: biased attention with sinks, sliding-window layers (layer_types), a biased
    router whose top-k logits are softmaxed, biased experts with a clamped SwiGLU."""
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    window = raw.get("sliding_window")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != num_layers or unknown or ("sliding_attention" in types and not window):
        raise ConfigError(f"GptOssForCausalLM: layer_types {types} / sliding_window {window!r} do not describe "
                          f"{num_layers} full or sliding attention layers")
    return dict(
        qkv_bias=bool(raw.get("attention_bias", True)),
        o_bias=bool(raw.get("attention_bias", True)),
        attention_sinks=True,
        sliding_windows=[int(window) if t == "sliding_attention" else None for t in types],
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


def _check_routing(architecture: str, cfg: dict[str, Any]) -> None:
    groups, topk_groups = cfg.get("num_expert_groups", 1), cfg.get("topk_expert_groups", 1)
    experts, top_k = cfg["num_experts"], cfg["top_k"]
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups:
        raise ConfigError(
            f"{architecture}: n_group={groups} must divide the {experts} experts and topk_group={topk_groups} "
            f"must be in 1..n_group"
        )
    if top_k > topk_groups * (experts // groups):
        raise ConfigError(
            f"{architecture}: num_experts_per_tok={top_k} exceeds the {topk_groups * (experts // groups)} "
            f"experts of topk_group={topk_groups} groups"
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPE_ARCHITECTURES:
        archs = [_MODEL_TYPE_ARCHITECTURES[raw["model_type"]]]
    for arch in archs:
        if arch in ARCHITECTURE_FAMILIES:
            return arch
    found = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
    raise ConfigError(f"unsupported model architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


class _Getter:
    """Required integer keys, trying each spelling in turn, with a clear error naming them."""

    def __init__(self, raw: dict[str, Any], architecture: str) -> None:
        self.raw = raw
        self.architecture = architecture

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            value = self.raw.get(key)
            if value is not None:
                return int(value)
        if default is not None:
            return default
        raise ConfigError(f"{self.architecture} config.json lacks {' / '.join(keys)}")


def _rope(raw: dict[str, Any], architecture: str) -> tuple[float, float, dict[str, Any] | None]:
    """(rope_theta, linear scaling factor, YaRN parameters or None) from `rope_parameters`
    (new) or `rope_theta` / `rope_scaling` (old)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "default":
        return float(theta), 1.0, None
    if rope_type == "linear":
        return float(theta), float(merged.get("factor", 1.0)), None
    if rope_type == "yarn":
        original = merged.get("original_max_position_embeddings")
        if not original:
            raise ConfigError(f"{architecture}: YaRN RoPE needs original_max_position_embeddings")
        factor = merged.get("factor") or raw.get("max_position_embeddings", 0) / original
        yarn = {
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(merged.get("beta_fast") or 32),
            "beta_slow": float(merged.get("beta_slow") or 1),
            "mscale": merged.get("mscale"),
            "mscale_all_dim": merged.get("mscale_all_dim"),
            "attention_factor": merged.get("attention_factor"),
            "truncate": bool(merged.get("truncate", True)),
        }
        return float(theta), 1.0, yarn
    raise ConfigError(f"{architecture}: RoPE type {rope_type!r} is not supported (only 'default', 'linear' and 'yarn')")


def _qwen_moe_layers(raw: dict[str, Any], num_layers: int, num_experts: int) -> list[int]:
    """Qwen MoE layer rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    if num_experts <= 0:
        return []
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for value in source if isinstance(source, list) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return ids
