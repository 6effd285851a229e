"""Paged decode attention in Triton: each decoding sequence's query heads attend over its keys
and values where they lie in the paged cache, read through its block table.

The torch decode path (models/attention.py) gathers each sequence's context out of the cache
into a padded [B, context, heads, dim] copy and calls SDPA: the gather reads and writes the
whole context once more than attention does, and grouping the sequences by length is host work
every step. Here one program per (sequence, KV head, block of 16 of its query heads) walks the
context in tiles of keys and scores them for those heads with an online softmax: one read of
the context, no copy, no grouping. GQA: a KV head's group of query heads; MLA's latent decodes:
one "KV head" (the cached latent) for all heads, the values its leading dims. A sliding window
starts the walk at the window; attention sinks (gpt-oss) join the softmax's denominator at the
end. A long context at a small batch leaves most of the GPU idle (no split of the context
across programs yet).

The same source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in Triton's
interpreter (how tests/paged_decode_cases.py checks it against the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from r3srv.kernels.launch import cdiv, next_power_of_2

MIN_DOT = 16  # tl.dot's smallest tile side: query heads per program, and the fewest keys per tile


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, rows_ptr, sinks_ptr, out_ptr,
    scale, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    ctx = tl.load(lens_ptr + seq)
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)  # this program's block of the group's heads
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok, dv_ok = d < HEAD_DIM, dv < V_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for lo in range(start // BLOCK_N * BLOCK_N, ctx, BLOCK_N):
        pos = lo + tl.arange(0, BLOCK_N)
        ok = (pos >= start) & (pos < ctx)
        block = tl.load(tables_ptr + seq * stride_tb + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = block * PAGE + pos % PAGE
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N] float32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a visible key
        decay = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * decay + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * decay[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if HAS_SINKS:  # each head's sink logit joins the denominator
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        decay = tl.exp(m - m_new)
        total = total * decay + tl.exp(sink - m_new)
        acc = acc * decay[:, None]
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & dv_ok[None, :])


def interpreter_enabled() -> bool:
    """True when this process imported triton with TRITON_INTERPRET=1 (CPU tensors only)."""
    return isinstance(_paged_decode_kernel, InterpretedFunction)


def kernel_constants(heads: int, kv_heads: int, head_dim: int, v_dim: int, page: int, *, sinks: bool, window: bool,
                     dtype: torch.dtype) -> dict:
    """The kernel's constexpr arguments for one layer shape."""
    block_d = max(MIN_DOT, next_power_of_2(head_dim))
    return dict(
        GROUP=heads // kv_heads, BLOCK_G=MIN_DOT,  # GQA groups fit one block; MLA's 16-128 heads take several
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        V_DIM=v_dim, BLOCK_DV=max(MIN_DOT, next_power_of_2(v_dim)),
        PAGE=page, BLOCK_N=32 if block_d <= 256 else MIN_DOT,  # MLA's 576-wide latents: smaller key tiles
        HAS_SINKS=sinks, HAS_WINDOW=window,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",  # float32 models: no TF32 rounding
        # Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot on their raw bits):
        # there the tiles go to float32 first; on a GPU, bf16 tiles take the tensor cores
        UPCAST=interpreter_enabled() and dtype != torch.float32,
    )


def launch_warps(constants: dict) -> int:
    return 4 if constants["BLOCK_D"] <= 256 else 8  # MLA's latents: more threads for the wider tiles


def paged_decode_triton(q, k_cache, v_cache, tables, lens, rows, out, *, page: int, scale: float,
                        window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """Decode attention into out[rows] (out [T, H, Dv]): q [T, H, D]; k_cache [slots, KVH, D],
    v_cache [slots, KVH, Dv]; per decoding sequence its block table row (tables [B, max_blocks]),
    context length (lens [B], this token included) and row in q (rows [B])."""
    num_seqs, heads, kv_heads = rows.shape[0], q.shape[1], k_cache.shape[1]
    if num_seqs == 0:
        return
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if out.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("out and the caches must be contiguous in their last dim")
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernel steps through a head's dims one by one
    constants = kernel_constants(heads, kv_heads, q.shape[2], v_cache.shape[2], page, sinks=sinks is not None,
                                 window=window is not None, dtype=q.dtype)
    grid = (num_seqs, kv_heads, cdiv(constants["GROUP"], constants["BLOCK_G"]))
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, tables, lens, rows, sinks if sinks is not None else q, out,
        float(scale), int(window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), out.stride(0), out.stride(1),
        **constants, num_warps=launch_warps(constants),
        enable_fp_fusion=True,  # pinned (Triton 3.9 warns its default will change)
    )


__all__ = ["interpreter_enabled", "kernel_constants", "launch_warps", "paged_decode_triton"]
