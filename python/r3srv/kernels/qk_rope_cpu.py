"""An attention layer's q/k norms and RoPE on the CPU in one call into the Rust core
(rust/src/qk_rope.rs): the fused projection's output split into contiguous q, k, v, the query
and key heads RMS-normalized per head (Qwen3's q_norm / k_norm) and rotated by the half-split
convention. It replaces about 25 torch ops per layer (split, reshapes, two norms on strided
views, two rotations, v's copy), whose dispatch costs more than the work at a decode step's
few tokens. float32 or bfloat16 (every tensor alike; bfloat16 rounds each op's result as
torch's bfloat16 ops do); anything else, `--no-rust-rope` (R3SRV_RUST_ROPE=0: the CPU backend,
ops/cpu.py, then does not take it) or a missing extension keep the torch ops. The rotation
gives torch's bits; the norms differ by rounding.
"""

from __future__ import annotations

import torch

from r3srv.kernels.rust_core import rust_kernel

qk_norm_rope_entry = rust_kernel("qk_norm_rope_f32")
BUILT = qk_norm_rope_entry is not None  # else the torch ops (kernels/rust_core.py)
# the kernel by dtype (an extension built before the bfloat16 one lacks it: None)
QK_NORM_ROPE_ENTRIES = {torch.float32: qk_norm_rope_entry, torch.bfloat16: rust_kernel("qk_norm_rope_bf16")}


def qk_norm_rope(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    threads: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]) from qkv [T, (heads + 2
    kv_heads) D]: q and k normed by `norms` (q_norm, k_norm [D]; None: not normed), then
    rotated over cos/sin's width (rope_cos_sin's [T, rotary]; None: not rotated), the tokens
    split over up to `threads` threads (the bits do not depend on it). None where the kernel
    does not apply."""
    kernel = QK_NORM_ROPE_ENTRIES.get(qkv.dtype)
    if kernel is None or not qkv.is_cpu:
        return None
    tokens = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or not qkv.is_contiguous() or tokens == 0:
        return None
    rotary = 0 if cos is None else cos.shape[-1]
    dtype = qkv.dtype
    if not kernel_ready(qkv, dtype) or (norms is not None and not (kernel_ready(norms[0], dtype)
                                                                  and kernel_ready(norms[1], dtype))):
        return None
    if cos is not None and not (kernel_ready(cos, dtype) and kernel_ready(sin, dtype)):
        return None
    if cos is not None and (cos.shape != (tokens, rotary) or sin.shape != cos.shape or rotary % 2 or rotary > head_dim):
        return None
    if norms is not None and any(n.shape != (head_dim,) for n in norms):
        return None
    q = qkv.new_empty(tokens, heads, head_dim)
    k = qkv.new_empty(tokens, kv_heads, head_dim)
    v = qkv.new_empty(tokens, kv_heads, head_dim)
    addresses = (qkv.data_ptr(), 0 if norms is None else norms[0].data_ptr(), 0 if norms is None else norms[1].data_ptr(),
                 0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(),
                 q.data_ptr(), k.data_ptr(), v.data_ptr())
    kernel(addresses, (tokens, heads, kv_heads, head_dim, rotary), eps, threads)
    return q, k, v


def kernel_ready(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel can read `t` in place: of `dtype`, on the CPU, contiguous, no autograd."""
    return t.dtype == dtype and t.is_cpu and t.is_contiguous() and not t.requires_grad
