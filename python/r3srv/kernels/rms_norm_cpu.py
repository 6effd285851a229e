"""RMSNorm of float32 or bfloat16 rows on the CPU in the Rust core (rust/src/rms_norm.rs): one
call instead of torch's composite CPU kernel, whose per-call cost exceeds the work on a decode
step's few rows (docs/benchmarks.md). The CPU backend's RMSNorm (ops/norm.py, ops/cpu.py) takes
it for contiguous CPU tensors of either dtype (x and weight alike); `--no-rust-rms-norm`
(R3SRV_RUST_RMS_NORM=0), a stale or missing extension keep torch's. float32 follows torch's
float32 rms_norm, bfloat16 the HF reference ops/norm.rms_norm follows (normalized in float32,
rounded, times the weight, rounded).
"""

from __future__ import annotations

import torch

from r3srv.kernels.rust_core import rust_kernel

rms_norm_entry = rust_kernel("rms_norm_f32")
BUILT = rms_norm_entry is not None  # else the torch path (kernels/rust_core.py)
# the kernel by dtype (an extension built before the bfloat16 one lacks it: None)
RMS_NORM_ENTRIES = {torch.float32: rms_norm_entry, torch.bfloat16: rust_kernel("rms_norm_bf16")}


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 1) -> torch.Tensor | None:
    """x / sqrt(mean(x^2, -1) + eps) * weight for float32 or bfloat16 CPU tensors, a prefill's
    rows split over up to `threads` threads (a row's bits do not depend on it), or None where
    the Rust kernel does not apply (the caller keeps torch's)."""
    kernel = RMS_NORM_ENTRIES.get(x.dtype)
    if kernel is None or weight.dtype != x.dtype or not x.is_cpu:
        return None
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0] or not (x.is_contiguous() and weight.is_contiguous()):
        return None
    if not weight.is_cpu or x.requires_grad or weight.requires_grad:
        return None
    dim = weight.shape[0]
    out = torch.empty_like(x)
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps, threads)
    return out
