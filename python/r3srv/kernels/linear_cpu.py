"""Linear layers of a few rows on the CPU through the Rust core (rust/src/linear.rs): a decode
step's projections (q/k/v, output, router gate, LM head) in one call each that reads the
weight once, row by row, instead of torch's GEMM call, whose per-call cost and cache-cold
weight reads dominate at one to a few rows (docs/benchmarks.md).

`linear` is F.linear's drop-in: the Rust kernel for contiguous float32 or bfloat16 CPU
tensors of one dtype with at most MAX_ROWS rows, torch otherwise, and always with
`--no-rust-linear` (R3SRV_RUST_LINEAR=0) or without a built extension. Results differ from
torch's by rounding (another order of the same sums; float32 arithmetic for bfloat16, rounded
once), and a row's result does not depend on the other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3srv import settings
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

_linear_cpu = rust_kernel("linear_cpu")
BUILT = _linear_cpu is not None  # else torch's F.linear (kernels/rust_core.py)

# More rows than this: torch's GEMM, whose packed kernels win once the weights are reused enough.
MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias)."""
    out = linear_rust(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def linear_rust(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) through the Rust kernel, or None where it does not apply."""
    dtype = RUST_DTYPES.get(x.dtype)
    if not BUILT or dtype is None or not x.is_cpu or not settings.current().rust_linear:
        return None
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return None
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or weight.shape[0] == 0 or x.requires_grad or weight.requires_grad:
        return None
    for t in (x, weight, bias):
        if t is not None and (t.dtype != x.dtype or not t.is_cpu or not t.is_contiguous()):
            return None
    if bias is not None and bias.shape != (weight.shape[0],):
        return None
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    addresses = (x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr())
    _linear_cpu(addresses, (rows, weight.shape[0], weight.shape[1]), dtype, settings.current().cpu_threads)
    return out
