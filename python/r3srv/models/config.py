"""ModelConfig: an MoE decoder's description, parsed from a raw Hugging Face config.json.

The shape every family shares is read here; the family module (models/families/) fills in the
typed specs (models/specs.py) in which it departs from a plain decoder. Parsing the raw JSON
keeps `transformers` out of the runtime and accepts both old and new key spellings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from r3srv.errors import ConfigError
from r3srv.models.families import SUPPORTED_ARCHITECTURES, Getter, family_of
from r3srv.models.quantization import parse_quantization
from r3srv.models.specs import (AttentionSpec, ExpertSpec, LinearAttentionSpec, NormSpec, RopeSpec, RouterSpec,
                                ScaleSpec)

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "parse_dtype"]

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
    """Everything the decoder, the loader and the engine need to know about a checkpoint: the
    shape every family shares, and the typed specs (models/specs.py) its family module
    (models/families/) fills in where the family departs from a plain decoder."""

    architecture: str
    model_type: str  # the family's name (models/families/<name>.py)
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
    tie_word_embeddings: bool = False
    norm: NormSpec = field(default_factory=NormSpec)
    rope: RopeSpec = field(default_factory=RopeSpec)
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    experts: ExpertSpec = field(default_factory=ExpertSpec)
    scales: ScaleSpec = field(default_factory=ScaleSpec)
    linear: LinearAttentionSpec | None = None  # hybrids: the layers with a recurrent state instead of K/V
    # one mixer per layer ("mamba", "attention", "moe" or "mlp") behind one norm, instead of
    # attention then MLP (Nemotron-H's layout); None: every layer is attention (or linear) then MLP
    layer_kinds: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.attention.mla is not None

    @property
    def linear_attention_layers(self) -> list[int]:
        return [] if self.linear is None else self.linear.layers

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
        return int(self.head_dim * self.rope.partial_factor)

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
        """The shape every family shares, read here; then the family module's `configure`."""
        family = family_of(raw)
        architecture = family.architecture_of(raw)
        if isinstance(raw.get("text_config"), dict):  # a multimodal checkpoint: serve its language model
            # (whether lm_head is the embedding is the outer config's say, as in transformers)
            outer = {key: raw[key] for key in ("architectures", "tie_word_embeddings") if key in raw}
            raw = {**raw, **raw["text_config"], **outer}
        raw = family.standard_spellings(raw)
        get = Getter(raw, architecture)

        hidden = get.int("hidden_size")
        heads = get.int("num_attention_heads")
        kv_heads = get.int("num_key_value_heads", default=heads)
        head_dim = raw.get("head_dim") or hidden // heads
        num_layers = family.count_layers(raw) if family.count_layers else get.int("num_hidden_layers")
        num_experts = get.int("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
        top_k = get.int("num_experts_per_tok", "moe_k")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"{architecture}: num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")

        rope_theta, rope_factor, rope_yarn = _rope(raw, architecture)
        fp8_block, mxfp4 = parse_quantization(raw, architecture)
        hidden_act = raw.get("hidden_act", "silu")
        cfg = cls(
            architecture=architecture,
            model_type=family.name,
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
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            norm=NormSpec(eps=float(raw.get("rms_norm_eps", 1e-6))),
            rope=RopeSpec(theta=rope_theta, linear_factor=rope_factor, yarn=rope_yarn),
            raw=raw,
        )
        cfg = family.configure(cfg, raw, get)
        if hidden_act != "silu":
            raise ConfigError(f"{architecture}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        if heads % kv_heads:
            raise ConfigError(f"{architecture}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        _check_routing(cfg)
        rotary = cfg.rotary_dim
        if cfg.rope.enabled and (rotary < 2 or rotary % 2 or rotary > cfg.head_dim):
            raise ConfigError(f"{architecture}: the rotary dims ({rotary}) must be even and in 2..head_dim={cfg.head_dim}")
        return cfg

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        mla, sparse = self.attention.mla, self.attention.sparse
        if mla is not None:  # one latent per token, no per-head K/V; DSA: an index key per token too
            indexed = (self.num_layers - len(sparse.shared_layers)) * sparse.head_dim if sparse else 0
            latents = len(self.attention_layers) * (mla.kv_lora_rank + self.head_dim)  # Kimi-Linear: MLA layers only
            return (latents + indexed) * block_size * dtype.itemsize
        return 2 * len(self.attention_layers) * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def linear_state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state in every linear layer (models/specs.py's LinearAttentionSpec)."""
        return 0 if self.linear is None else self.linear.state_bytes(self.hidden_size, dtype)


def _check_routing(cfg: ModelConfig) -> None:
    groups, topk_groups = cfg.router.num_groups, cfg.router.topk_groups
    experts, top_k = cfg.num_experts, cfg.top_k
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups:
        raise ConfigError(
            f"{cfg.architecture}: n_group={groups} must divide the {experts} experts and topk_group={topk_groups} "
            f"must be in 1..n_group"
        )
    if top_k > topk_groups * (experts // groups):
        raise ConfigError(
            f"{cfg.architecture}: num_experts_per_tok={top_k} exceeds the {topk_groups * (experts // groups)} "
            f"experts of topk_group={topk_groups} groups"
        )


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
