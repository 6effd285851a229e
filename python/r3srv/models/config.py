"""ModelConfig: one flat description of an MoE decoder, parsed from a raw Hugging Face config.json.

The four families differ in a handful of switches (q/k norm width, qkv clipping, router
renormalisation, shared expert, which layers are MoE). Parsing them here, from the raw JSON,
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

logger = logging.getLogger(__name__)

# architecture name (config.json "architectures"[0]) -> family
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
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
    model_type: str  # the family: qwen3_moe | qwen2_moe | mixtral | olmoe
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
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # "linear" RoPE scaling divides positions by this
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # attention switches
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over head_dim (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None
    # router switches
    renormalize: bool = True  # top-k weights renormalised to sum to one
    shared_expert_intermediate_size: int = 0  # > 0: Qwen2-MoE shared expert with a sigmoid gate
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

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
        num_experts = get.int("num_local_experts", "num_experts")
        top_k = get.int("num_experts_per_tok")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"{architecture}: num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")

        rope_theta, rope_factor = _rope(raw, architecture)
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
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling_factor=rope_factor,
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
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
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
        return cls(**cfg)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


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


def _rope(raw: dict[str, Any], architecture: str) -> tuple[float, float]:
    """(rope_theta, linear scaling factor) from `rope_parameters` (new) or `rope_theta`/`rope_scaling` (old)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), 1.0
    if rope_type == "linear":
        return float(theta), float(params.get("factor", scaling.get("factor", 1.0)))
    raise ConfigError(f"{architecture}: RoPE type {rope_type!r} is not supported (only 'default' and 'linear')")


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
