"""Qwen3-VL's vision tower, which Qwen3.5's checkpoints share without the deepstack mergers:
patch embedding, a learned position grid resampled (bilinear) to each image's patch grid,
LayerNorm ViT blocks with 2-D rotary attention, then a merger of each merge_size x merge_size
block of patches into one language-model embedding; Qwen3-VL also merges the outputs of a few
early blocks (deepstack), which the decoder adds to its first layers' hidden states at the
image's positions. Module names follow the checkpoint's (model.visual.*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.errors import ConfigError
from r3srv.models.vision.layers import (PatchEmbed, VisionAttention, VisionOutput, VisionTower, axial_rope, frozen,
                                        grid_sizes, image_lengths, patch_coords)

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, deepstack: bool) -> QwenVisionConfig:
        """transformers' Qwen3VLMoeVisionConfig / Qwen3_5MoeVisionConfig defaults where `raw` is silent."""
        d = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
             "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "out_hidden_size": 3584, "num_position_embeddings": 2304}
        d |= {k: raw[k] for k in d if raw.get(k) is not None}
        indexes = tuple(raw.get("deepstack_visual_indexes", (8, 16, 24))) if deepstack else ()
        theta = float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        cfg = cls(**{k: v if k == "hidden_act" else int(v) for k, v in d.items()}, deepstack_visual_indexes=indexes,
                  rope_theta=theta)
        side = int(cfg.num_position_embeddings ** 0.5)
        if cfg.hidden_act not in _ACTIVATIONS or side * side != cfg.num_position_embeddings:
            raise ConfigError(f"vision_config: hidden_act {cfg.hidden_act!r} or num_position_embeddings "
                              f"{cfg.num_position_embeddings} (a square grid) is not supported")
        if cfg.hidden_size % cfg.num_heads or any(not 0 <= i < cfg.depth for i in indexes):
            raise ConfigError(f"vision_config: {cfg.num_heads} heads must divide hidden_size {cfg.hidden_size} and "
                              f"deepstack_visual_indexes {list(indexes)} must be blocks of {cfg.depth}")
        return cfg


class _Mlp(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, qkv_bias=True, proj_bias=True)
        self.mlp = _Mlp(cfg)

    def forward(self, x, lengths, cos, sin):
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """merge_size**2 neighbouring patches -> one embedding: LayerNorm per patch (or, after the
    shuffle, over the concatenation: the deepstack mergers), then a GELU MLP."""

    def __init__(self, cfg: QwenVisionConfig, *, norm_after_shuffle: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_after_shuffle = norm_after_shuffle
        self.norm = nn.LayerNorm(self.width if norm_after_shuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.norm_after_shuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTower(VisionTower):
    def __init__(self, cfg: QwenVisionConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg, norm_after_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(cfg, norm_after_shuffle=True) for _ in cfg.deepstack_visual_indexes)
        frozen(self.to(dtype=dtype, device=device))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput:
        cfg = self.cfg
        coords = patch_coords(grids, cfg.spatial_merge_size, pixels.device)
        x = self.patch_embed(pixels)
        x = x + self._positions(coords, grids).to(x.dtype)
        cos, sin = axial_rope(coords, cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        lengths = image_lengths(grids)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, lengths, cos, sin)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), deepstack)

    def _positions(self, coords: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square position grid resampled bilinearly (corners aligned) to each
        image's grid: four weighted taps per patch."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        sizes = grid_sizes(grids, coords.device)
        taps, weights = [], []
        for axis in (0, 1):
            src = coords[:, axis].float() * (side - 1) / torch.clamp(sizes[:, axis] - 1, min=1)
            floor = torch.floor(src)
            offsets = torch.arange(2, device=coords.device)
            taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
            weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
        index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)
