"""RMSNorm, in the three forms the families' references compute it, by NormSpec (`norm_kind`):

- "default": in float32, cast back before the weight (the HF reference); float32 inputs and
  weights take one fused kernel (torch's rms_norm, or the CPU backend's Rust one), bfloat16 ones
  the CPU backend's Rust kernel of the same steps;
- "zero_centered": the stored weight is w - 1 (Qwen3-Next, Qwen3.5), scaled by 1 + w in float32;
- "float32_weight": scaled by the weight in float32, cast back last (Nemotron-H).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> y
NORM_KINDS = ("default", "zero_centered", "float32_weight")


def norm_kind(spec) -> str:
    """The kind of RMSNorm a model's NormSpec asks for."""
    if spec.zero_centered:
        return "zero_centered"
    return "float32_weight" if spec.weight_float32 else "default"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as the HF reference does."""
    if x.dtype == weight.dtype == torch.float32:  # nothing to cast: one kernel
        return F.rms_norm(x, weight.shape, weight, eps)
    return _scaled_back(x, weight, eps)


def _scaled_back(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose stored weight is w - 1 (Qwen3-Next, Qwen3.5): scaled by 1 + w in float32,
    cast back last, as their reference does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rms_norm_float32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by the weight in float32, cast back last (Nemotron-H's reference)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


REFERENCE_NORMS: dict[str, NormFn] = {
    "default": rms_norm, "zero_centered": rms_norm_zero_centered, "float32_weight": rms_norm_float32_weight}


def kernel_rms_norm(kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor | None]) -> NormFn:
    """The "default" RMSNorm with float32 or bfloat16 rows (x and weight alike) through `kernel`,
    which computes the same steps in one call (None where it declines: torch's)."""

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == weight.dtype and x.dtype in KERNEL_NORM_DTYPES:
            out = kernel(x, weight, eps)
            if out is not None:
                return out
        return rms_norm(x, weight, eps)

    return norm


KERNEL_NORM_DTYPES = (torch.float32, torch.bfloat16)
