"""ModelConfig: one flat description of an MoE decoder, parsed from a raw Hugging Face config.json.

The families differ in a handful of switches (q/k norm width, qkv clipping, partial
rotary, router scoring / bias / groups / renormalisation / scaling, shared expert, which
layers are MoE; each family's are read in models/families.py). Parsing them from the raw
JSON keeps `transformers` out of the runtime and accepts both old and new key spellings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from r3srv.errors import ConfigError
from r3srv.models.families import family_switches, nemotron_h_layer_kinds, standard_spellings
from r3srv.models.quantization import parse_quantization


# architecture name (config.json "architectures"[0]) -> family
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "FlexOlmoForCausalLM": "flex_olmo",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "GptOssForCausalLM": "gpt_oss",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Dots1ForCausalLM": "dots1",
    "Qwen3NextForCausalLM": "qwen3_next",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "NemotronHForCausalLM": "nemotron_h",
    "KimiLinearForCausalLM": "kimi_linear",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "AfmoeForCausalLM": "afmoe",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_FAMILIES)
_MODEL_TYPE_ARCHITECTURES = {family: arch for arch, family in reversed(ARCHITECTURE_FAMILIES.items())}

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
    model_type: str  # the family (ARCHITECTURE_FAMILIES' values; models/families.py)
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
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; models/dsa.py): each query attends to the
    # index_topk keys its indexer scores best; index_shared_layers reuse the last indexer's choice
    index_topk: int = 0  # > 0: DSA
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False
    index_shared_layers: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # attention switches
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    sliding_windows: list[int | None] | None = None  # per layer: keys within this many positions back
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
    # hybrid models (Qwen3-Next, Qwen3.5): Gated DeltaNet layers (models/gated_deltanet.py)
    # hold a per-sequence state instead of K/V; the other layers are full attention
    linear_attention_layers: list[int] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    linear_projection_layout: str = "qkvz_ba"  # Qwen3-Next's in_proj_qkvz/ba; Qwen3.5: "qkv_z_b_a"
    # "kda": Kimi-Linear's per-channel decay (models/kda.py); "mamba2": Granite-4.0-H (models/mamba2.py);
    # "short_conv": LFM2's gated convolution alone (models/short_conv.py)
    linear_attention_kind: str = "gated_deltanet"
    short_conv_bias: bool = False  # LFM2's conv_bias: biases on in_proj, the convolution and out_proj
    attention_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the output
    # Nemotron-H: every layer is one mixer ("mamba", "attention", "moe" or "mlp") behind one norm,
    # instead of attention then MLP; its Mamba-2 layers (models/mamba2.py) are the linear ones
    layer_kinds: list[str] | None = None
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_min: float = 0.0  # the step dt is clamped to at least this
    use_rope: bool = True  # False: attention without positions (Nemotron-H)
    # Granite's scalars: embeddings times embedding_multiplier, each residual branch times
    # residual_multiplier, logits divided by logits_scaling, attention scaled by attention_scale
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    zero_centered_norms: bool = False  # RMSNorm weights stored as w - 1 (scaled by 1 + w, in float32)
    norm_weight_float32: bool = False  # RMSNorm scaled by its weight in float32, cast back last
    # Arcee's AFMoE: a norm on each branch's output too (sandwich), a separate sigmoid-gate
    # projection on the attention output, RoPE only in the layers of rope_layers (None: all)
    sandwich_norms: bool = False
    pre_norms: bool = True  # False: no norm before a branch, only on its output (FlexOlmo, OLMo-2's layout)
    attention_gate_proj: bool = False
    rope_layers: list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def attention_layers(self) -> list[int]:
        """Layers with a paged KV cache (all but the linear ones; Nemotron-H: its attention layers)."""
        if self.layer_kinds is not None:
            return [i for i, kind in enumerate(self.layer_kinds) if kind == "attention"]
        linear = set(self.linear_attention_layers)
        return [i for i in range(self.num_layers) if i not in linear]

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
        if isinstance(raw.get("text_config"), dict):  # a multimodal checkpoint: serve its language model
            # (whether lm_head is the embedding is the outer config's say, as in transformers)
            outer = {key: raw[key] for key in ("architectures", "tie_word_embeddings") if key in raw}
            raw = {**raw, **raw["text_config"], **outer}
        raw = standard_spellings(family, raw)
        get = _Getter(raw, architecture)

        hidden = get.int("hidden_size")
        heads = get.int("num_attention_heads")
        kv_heads = get.int("num_key_value_heads", default=heads)
        head_dim = raw.get("head_dim") or hidden // heads
        # Nemotron-H: the layer list is the count (transformers 5 writes no num_hidden_layers)
        num_layers = len(nemotron_h_layer_kinds(raw)) if family == "nemotron_h" else get.int("num_hidden_layers")
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
            intermediate_size=get.int("intermediate_size", "moe_intermediate_size"),  # Qwen3.5 has no dense MLP
            moe_intermediate_size=get.int("intermediate_size", "moe_intermediate_size"),
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
        cfg.update(family_switches(family, raw, get, num_layers=num_layers, head_dim=int(head_dim), num_experts=num_experts))
        if cfg["hidden_act"] != "silu":
            raise ConfigError(f"{architecture}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        if heads % kv_heads:
            raise ConfigError(f"{architecture}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        _check_routing(architecture, cfg)
        rotary = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
        if cfg.get("use_rope", True) and (rotary < 2 or rotary % 2 or rotary > cfg["head_dim"]):
            raise ConfigError(f"{architecture}: the rotary dims ({rotary}) must be even and in 2..head_dim={cfg['head_dim']}")
        return cls(**cfg)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        if self.is_mla:  # one latent per token, no per-head K/V; DSA: an index key per token too
            indexed = (self.num_layers - len(self.index_shared_layers)) * self.index_head_dim if self.index_topk else 0
            latents = len(self.attention_layers) * (self.kv_lora_rank + self.head_dim)  # Kimi-Linear: MLA layers only
            return (latents + indexed) * block_size * dtype.itemsize
        return 2 * len(self.attention_layers) * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def linear_state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state in every linear layer: the convolution's last kernel - 1 inputs
        (model dtype) and the float32 recurrent state (Gated DeltaNet: a matrix per value head;
        Mamba-2: head_dim x state_size per head)."""
        if self.layer_kinds is not None or self.linear_attention_kind == "mamba2":
            conv = (self.mamba_num_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state_size) * (
                self.mamba_conv_kernel - 1)
            recurrent = self.mamba_num_heads * self.mamba_head_dim * self.mamba_state_size
        elif self.linear_attention_kind == "short_conv":  # the convolution's window alone
            conv, recurrent = self.hidden_size * (self.linear_conv_kernel_dim - 1), 0
        elif self.linear_attention_kind == "kda":  # q, k and v convolved; a dk x dv matrix per head
            heads, dim = self.linear_num_value_heads, self.linear_value_head_dim
            conv, recurrent = 3 * heads * dim * (self.linear_conv_kernel_dim - 1), heads * dim * dim
        else:
            conv = (2 * self.linear_num_key_heads * self.linear_key_head_dim
                    + self.linear_num_value_heads * self.linear_value_head_dim) * (self.linear_conv_kernel_dim - 1)
            recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return len(self.linear_attention_layers) * (conv * dtype.itemsize + recurrent * 4)


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


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for value in source if isinstance(source, list) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return ids
