"""config.json reading shared by several families: required keys, per-layer kinds and windows."""

from __future__ import annotations

from typing import Any

from r3srv.errors import ConfigError


class Getter:
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


def after_dense(num_dense: int, num_layers: int) -> list[int]:
    """MoE layers after the first `num_dense` dense ones."""
    return list(range(min(num_dense, num_layers), num_layers))


def qwen_moe_layers(raw: dict[str, Any], num_layers: int, num_experts: int) -> list[int]:
    """Qwen MoE layer rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    if num_experts <= 0:
        return []
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def mlp_layer_types(raw: dict[str, Any], num_layers: int, architecture: str, moe_layers: list[int]) -> list[int]:
    """The MoE layers by mlp_layer_types (dense / sparse) when the config lists them, else `moe_layers`."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        return moe_layers
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ConfigError(f"{architecture}: mlp_layer_types {kinds} must be {num_layers} of dense / sparse")
    return [i for i, kind in enumerate(kinds) if kind == "sparse"]


def layer_windows(raw: dict[str, Any], num_layers: int, architecture: str, default: list[str] | None = None):
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


def hybrid_layer_types(raw: dict[str, Any], num_layers: int, architecture: str, default: list[str]) -> list[int]:
    """The linear-attention layers of layer_types (linear_attention / full_attention), else of `default`."""
    types = raw.get("layer_types")
    types = default if types is None else types
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"{architecture}: layer_types {types} must be {num_layers} of linear_attention / full_attention")
    return [i for i, t in enumerate(types) if t == "linear_attention"]


def partial_rotary(raw: dict[str, Any], default: float) -> float:
    """partial_rotary_factor from rope_parameters (new) or the top level (old)."""
    rope = raw.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", default)))


def with_mrope(rope, raw: dict[str, Any], architecture: str, *, interleaved: bool, rotary_dim: int):
    """`rope` with the M-RoPE sections of rope_parameters (new) or rope_scaling (old), if any.
    In three runs they must share out the rotary_dim // 2 frequencies exactly; interleaved,
    sections past the last frequency are cut off (as transformers' slices cut them)."""
    from dataclasses import replace

    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    section = params.get("mrope_section")
    if section is None:
        return rope
    if rope.yarn or rope.linear_factor != 1.0:
        raise ConfigError(f"{architecture}: M-RoPE with scaled (linear or YaRN) positions is not supported")
    section = tuple(int(s) for s in section)
    if len(section) != 3 or min(section) < 0 or (not interleaved and sum(section) != rotary_dim // 2):
        raise ConfigError(f"{architecture}: mrope_section {list(section)} does not share out the "
                          f"{rotary_dim // 2} rotary frequencies among 3 axes")
    return replace(rope, mrope_section=section, mrope_interleaved=interleaved)


def vision_spec(raw: dict[str, Any], architecture: str, merge_default: int = 2):
    """The image inputs of a checkpoint with a vision_config (None without one)."""
    from r3srv.models.specs import VisionSpec

    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        return None
    if raw.get("image_token_id") is None:
        raise ConfigError(f"{architecture}: a vision_config needs the image_token_id of its placeholders")
    return VisionSpec(image_token_id=int(raw["image_token_id"]),
                      merge_size=int(vision.get("spatial_merge_size") or merge_default))
