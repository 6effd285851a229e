"""Pieces the vision towers share: patch embedding, 2-D (axial) rotary positions over each
image's patch grid, and attention within each image (models/vision/qwen3_vl.py, glm4v.py).

Patches arrive in merge-block order (each merge_size x merge_size block of neighbouring
patches together, blocks row by row: r3srv/vision/processor.py's patchify), so every per-patch
table here is laid out in that order too."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VisionOutput:
    embeds: torch.Tensor  # [tokens, text hidden]: one per merged block, images in order
    deepstack: list[torch.Tensor]  # per deepstack layer, the same shape (Qwen3-VL; empty otherwise)


class VisionTower(nn.Module):
    """What the engine reads of a tower (models/vision/qwen3_vl.py, glm4v.py): its config's
    spatial_merge_size, and forward(pixels [patches, C * T * P * P], grids: each image's (t, h,
    w) patches) -> VisionOutput."""

    cfg: object

    @property
    def merge_size(self) -> int:
        return self.cfg.spatial_merge_size

    @property
    def num_deepstack(self) -> int:
        """Feature sets besides the embeddings (Qwen3-VL's deepstack layers; 0 for the others)."""
        return len(getattr(self.cfg, "deepstack_visual_indexes", ()))

    @property
    def embeds_width(self) -> int:
        """Columns of the tower's output as vLLM's image_embeds carry it: the embeddings, then each
        deepstack feature set."""
        return self.cfg.out_hidden_size * (1 + self.num_deepstack)


def frozen(module: nn.Module) -> nn.Module:
    """The module with its parameters frozen (the loader fills them; nothing trains)."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class PatchEmbed(nn.Module):
    """A (temporal_patch x patch x patch) convolution with a matching stride: one vector per patch."""

    def __init__(self, in_channels: int, temporal_patch: int, patch: int, hidden: int, *, bias: bool = True) -> None:
        super().__init__()
        self.shape = (in_channels, temporal_patch, patch, patch)
        kernel = (temporal_patch, patch, patch)
        self.proj = nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return self.proj(pixels.to(weight.dtype).view(-1, *self.shape)).view(-1, weight.shape[0])


def patch_coords(grids: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """[patches, 2] long: each patch's (row, column) in its image's grid, in merge-block order."""
    coords = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows, cols = rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()
        coords.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(coords)


def grid_sizes(grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """[patches, 2] long: the (rows, columns) of each patch's image grid."""
    sizes = torch.tensor([[h, w] for _, h, w in grids], device=device)
    return sizes.repeat_interleave(torch.tensor([t * h * w for t, h, w in grids], device=device), dim=0)


def axial_rope(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [patches, head_dim] in float32: a quarter of the head's frequencies turn with the
    row, a quarter with the column, each half then repeated (rotate-half layout)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=coords.device) / quarter))
    freqs = coords[..., None].float() * inv_freq  # [patches, 2, head_dim // 4]
    both = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    both = torch.cat([both, both], dim=-1)
    return both.cos(), both.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] rotated in float32 (rotate-half), cast back."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Full (non-causal) attention among the patches of each image, none across images."""

    def __init__(self, hidden: int, heads: int, *, qkv_bias: bool, proj_bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=qkv_bias)
        self.proj = nn.Linear(hidden, hidden, bias=proj_bias)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scale = q.shape[-1] ** -0.5
        # [1, heads, patches, head_dim], cut at the images' boundaries
        q, k, v = (t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v))
        out = torch.cat([F.scaled_dot_product_attention(a, b, c, scale=scale).transpose(1, 2)
                         for a, b, c in zip(q, k, v)], dim=1)
        return self.proj(out.reshape(n, -1))


def image_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """Patches per attention segment: each frame of each image on its own."""
    return [h * w for t, h, w in grids for _ in range(t)]
