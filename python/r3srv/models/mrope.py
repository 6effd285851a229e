"""M-RoPE (multi-axis rotary positions) of the vision-language families: each token has three
position ids (temporal, height, width; equal for text) and each rotary frequency turns with
one of them, as the family's RopeSpec.mrope_section shares them out."""

from __future__ import annotations

import torch

from r3srv.models.specs import RopeSpec


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, rope: RopeSpec,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary] for positions [3, T], laid out as ops.rotary.rope_cos_sin's."""
    freqs = positions.float()[..., None] * inv_freq  # [3, T, rotary / 2]
    t, h, w = rope.mrope_section
    if rope.mrope_interleaved:  # frequency i turns with axis i % 3 while that axis has some left
        mixed = freqs[0].clone()
        mixed[..., 1:3 * h:3] = freqs[1, ..., 1:3 * h:3]
        mixed[..., 2:3 * w:3] = freqs[2, ..., 2:3 * w:3]
    else:  # three runs: t frequencies on the temporal id, then h on the height, w on the width
        mixed = torch.cat([freqs[i % 3, ..., run] for i, run in enumerate(_runs((t, h, w)))], dim=-1)
    emb = torch.cat((mixed, mixed), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _runs(section: tuple[int, int, int]) -> list[slice]:
    starts = [0, section[0], section[0] + section[1]]
    return [slice(s, s + n) for s, n in zip(starts, section)]

