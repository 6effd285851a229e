"""GLM-4.5V's vision tower (glm4v_moe): patch embedding and an RMSNorm, a learned position
grid resampled bicubically to each image's grid, RMSNorm ViT blocks with SwiGLU MLPs and 2-D
rotary attention, then a strided convolution over each merge_size x merge_size block of
patches and a SwiGLU merger into one language-model embedding. Module names follow the
checkpoint's (model.visual.*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from r3srv.errors import ConfigError
from r3srv.ops.norm import rms_norm
from r3srv.models.vision.layers import (PatchEmbed, VisionAttention, VisionOutput, VisionTower, axial_rope, frozen,
                                        grid_sizes, image_lengths, patch_coords)


@dataclass(frozen=True)
class GlmVisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    in_channels: int
    image_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    intermediate_size: int
    attention_bias: bool
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GlmVisionConfig:
        """transformers' Glm4vMoeVisionConfig defaults where `raw` is silent."""
        d = {"depth": 24, "hidden_size": 1536, "num_heads": 12, "in_channels": 3, "image_size": 336, "patch_size": 14,
             "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096, "intermediate_size": 13696}
        d = {k: int(raw[k]) if raw.get(k) is not None else v for k, v in d.items()}
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"vision_config: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        cfg = cls(**d, attention_bias=bool(raw.get("attention_bias", False)),
                  rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                  rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        if cfg.hidden_size % cfg.num_heads or cfg.image_size % cfg.patch_size:
            raise ConfigError(f"vision_config: {cfg.num_heads} heads must divide hidden_size {cfg.hidden_size} and "
                              f"patch_size {cfg.patch_size} image_size {cfg.image_size}")
        return cfg


class _RmsNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _SwiGlu(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: GlmVisionConfig) -> None:
        super().__init__()
        self.norm1 = _RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = _RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, qkv_bias=cfg.attention_bias, proj_bias=False)
        self.mlp = _SwiGlu(cfg.hidden_size, cfg.out_hidden_size)  # GLM's block MLP is out_hidden_size wide

    def forward(self, x, lengths, cos, sin):
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, cfg: GlmVisionConfig) -> None:
        super().__init__()
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, coords: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The square position grid sampled bicubically (float32, border padding) at each
        patch's centre, scaled to its image's grid."""
        weight = self.position_embedding.weight
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
        centres = ((coords.float() + 0.5) / sizes.float()) * 2 - 1  # [patches, (row, col)] in [-1, 1]
        grid = centres.flip(-1)[None, :, None, :]  # grid_sample reads (x = column, y = row)
        sampled = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled[0, :, :, 0].transpose(0, 1).to(weight.dtype)


class _Merger(_SwiGlu):
    """A projection, LayerNorm and GELU before the SwiGLU (whose projections sit beside them)."""

    def __init__(self, cfg: GlmVisionConfig) -> None:
        super().__init__(cfg.out_hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.out_hidden_size, cfg.out_hidden_size, bias=False)
        self.post_projection_norm = nn.LayerNorm(cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class GlmVisionTower(VisionTower):
    def __init__(self, cfg: GlmVisionConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.patch_embed = PatchEmbed(cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg)
        self.post_conv_layernorm = _RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m = cfg.spatial_merge_size
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=m, stride=m)
        self.post_layernorm = _RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        frozen(self.to(dtype=dtype, device=device))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput:
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        coords = patch_coords(grids, m, pixels.device)
        x = self.post_conv_layernorm(self.patch_embed(pixels))
        cos, sin = axial_rope(coords, cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        x = x + self.embeddings(coords, grid_sizes(grids, pixels.device))
        lengths = image_lengths(grids)
        for block in self.blocks:
            x = block(x, lengths, cos, sin)
        x = self.post_layernorm(x).view(-1, m, m, cfg.hidden_size).permute(0, 3, 1, 2)
        x = self.downsample(x).view(-1, cfg.out_hidden_size)
        return VisionOutput(self.merger(x), [])
