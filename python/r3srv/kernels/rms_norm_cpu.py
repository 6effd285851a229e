"""RMSNorm of float32 rows on the CPU in the Rust core (rust/src/rms_norm.rs): one call instead
of torch's composite CPU kernel, whose per-call cost exceeds the work on a decode step's few
rows (docs/benchmarks.md). The CPU backend's RMSNorm (ops/norm.py, ops/cpu.py) takes it for
contiguous float32 CPU tensors; `--no-rust-rms-norm` (R3SRV_RUST_RMS_NORM=0), a stale or missing
extension keep torch's.
"""

from __future__ import annotations

import torch

from r3srv.kernels.rust_core import rust_kernel

rms_norm_entry = rust_kernel("rms_norm_f32")
BUILT = rms_norm_entry is not None  # else the torch path (kernels/rust_core.py)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x^2, -1) + eps) * weight for float32 CPU tensors, or None where the Rust
    kernel does not apply (the caller keeps torch's)."""
    if not BUILT or not x.is_cpu:
        return None
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0] or not (x.is_contiguous() and weight.is_contiguous()):
        return None
    if not weight.is_cpu or x.requires_grad or weight.requires_grad:
        return None
    dim = weight.shape[0]
    out = torch.empty_like(x)
    rms_norm_entry(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out
