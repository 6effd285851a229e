"""Rotary position embeddings: the per-step cos/sin and the two rotation layouts (every backend
rotates with these today; a backend's fused q/k norms + RoPE, ops/heads.py, gives their bits).
The frequencies a model rotates by (default, linear, YaRN) are computed once when it is built."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, sin) -> rotated x


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, yarn: dict) -> tuple[torch.Tensor, float]:
    """YaRN's (inv_freq, attention factor for cos/sin), as the YaRN paper and transformers define them:
    high frequencies kept, low ones interpolated by `factor`, a linear ramp between."""
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    scaling_factor: float = 1.0,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for the given positions (computed per step: no max-length table).

    scaling_factor: linear RoPE scaling (positions divided by it); attention_factor: YaRN's
    multiplier of cos and sin."""
    pos = positions.float()
    if scaling_factor != 1.0:
        pos = pos / scaling_factor
    freqs = pos[:, None] * inv_freq[None, :]
    # each half's values once, then repeated: the same values as cos/sin of the doubled angles
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.to(dtype), sin.to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the half-split (GPT-NeoX / HF Llama) convention.

    cos/sin narrower than head_dim (partial rotary, GLM-4.5) rotate the leading dims only.
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    # x * cos + rotate_half(x) * sin written per half: cos and sin repeat their first half
    # (rope_cos_sin), so this is the same arithmetic, bit for bit, without the rotated copy
    half = rotary // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] rotated by interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout).

    The result comes out de-interleaved (evens' rotations, then odds'), as transformers writes
    it: queries and keys get the same permutation, so their dot products are unchanged.
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary: the leading dims only
        return torch.cat((apply_rope_interleaved(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


ROTATIONS: dict[str, RotateFn] = {"half": apply_rope, "interleaved": apply_rope_interleaved}
