"""Linear layers: y = x W^T (+ b), F.linear's contract. The CPU backend takes the Rust kernel
for a few rows (kernels/linear_cpu.py: a decode step's projections), torch's GEMM otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> y


def kernel_linear(kernel: Callable[..., torch.Tensor | None], threads: int) -> LinearFn:
    """F.linear through `kernel(x, weight, bias, threads)` where it applies (else None: torch's)."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = kernel(x, weight, bias, threads)
        return F.linear(x, weight, bias) if out is None else out

    return linear
