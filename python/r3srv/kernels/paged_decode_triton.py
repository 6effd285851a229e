"""Paged decode attention in Triton: each decoding sequence's query heads attend over its keys
and values where they lie in the paged cache, read through its block table.

The torch decode path (ops/attention.py) gathers each sequence's context out of the cache
into a padded [B, context, heads, dim] copy and calls SDPA: the gather reads and writes the
whole context once more than attention does, and grouping the sequences by length is host work
every step. Here one program per (sequence, KV head, block of 16 of its query heads) walks the
context in tiles of keys and scores them for those heads with an online softmax: one read of
the context, no copy, no grouping. GQA: a KV head's group of query heads; MLA's latent decodes:
one "KV head" (the cached latent) for all heads, the values its leading dims. A sliding window
starts the walk at the window; attention sinks (gpt-oss) join the softmax's denominator at the
end. A long context at a small batch would leave most of the GPU idle in so few programs, so
there the context is split across programs (flash-decoding): each writes its part's running
max, denominator and unnormalised output, and a second kernel combines the parts (and the
sinks) per head.

The same source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in Triton's
interpreter (how tests/paged_decode_cases.py checks it against the torch path).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from r3srv.kernels.launch import cdiv, next_power_of_2

MIN_DOT = 16  # tl.dot's smallest tile side: query heads per program, and the fewest keys per tile


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, rows_ptr, sinks_ptr, out_ptr, part_ptr, part_acc_ptr,
    scale, window, splits,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    ctx = tl.load(lens_ptr + seq)
    head_block = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    g = head_block * BLOCK_G + tl.arange(0, BLOCK_G)  # this program's block of the group's heads
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
    end = ctx
    if SPLIT:  # this program's part of the visible keys: whole tiles, the last parts maybe empty
        part = tl.cdiv(tl.cdiv(ctx - start, splits), BLOCK_N) * BLOCK_N
        start = start + split * part
        end = tl.minimum(start + part, ctx)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # from the tile that holds `start`; none for an empty part (a tile without a visible key
    # would make the running max -inf - -inf)
    first = tl.where(start < end, start // BLOCK_N * BLOCK_N, end)
    for lo in range(first, end, BLOCK_N):
        pos = lo + tl.arange(0, BLOCK_N)
        ok = (pos >= start) & (pos < end)
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
    if SPLIT:  # this part's max, denominator and unnormalised output: [seq, head, split(, dv)]
        at = (seq * GROUP * tl.num_programs(1) + heads) * splits + split
        tl.store(part_ptr + at * 2, m, mask=g_ok)
        tl.store(part_ptr + at * 2 + 1, total, mask=g_ok)
        tl.store(part_acc_ptr + at[:, None] * V_DIM + dv[None, :], acc, mask=g_ok[:, None] & dv_ok[None, :])
    else:
        if HAS_SINKS:  # each head's sink logit joins the denominator
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, sink)
            decay = tl.exp(m - m_new)
            total = total * decay + tl.exp(sink - m_new)
            acc = acc * decay[:, None]
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])


@triton.jit
def _combine_splits_kernel(
    part_ptr, part_acc_ptr, rows_ptr, sinks_ptr, out_ptr, splits, stride_ot, stride_oh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program per (decoding sequence, head): the parts' softmaxes rescaled to their common
    max and summed (an empty part's max is -inf: it weighs 0), the sink joining the denominator."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    sp_ok, dv_ok = sp < splits, dv < V_DIM
    at0 = (seq * tl.num_programs(1) + head) * splits
    at = at0 + sp
    m = tl.load(part_ptr + at * 2, mask=sp_ok, other=float("-inf"))
    total = tl.load(part_ptr + at * 2 + 1, mask=sp_ok, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: the first part always holds a visible key
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
        weight = tl.exp(m - m_all)
        denominator = tl.sum(total * weight, axis=0) + tl.exp(sink - m_all)
    else:
        weight = tl.exp(m - m_all)
        denominator = tl.sum(total * weight, axis=0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for part in range(splits):  # one part's [Dv] row at a time: MLA's 512-wide rows stay small
        m_part = tl.load(part_ptr + (at0 + part) * 2)
        acc += tl.exp(m_part - m_all) * tl.load(part_acc_ptr + (at0 + part) * V_DIM + dv, mask=dv_ok, other=0.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dv, (acc / denominator).to(out_ptr.dtype.element_ty),
             mask=dv_ok)


def interpreter_enabled() -> bool:
    """True when this process imported triton with TRITON_INTERPRET=1 (CPU tensors only)."""
    return isinstance(_paged_decode_kernel, InterpretedFunction)


# A part of a split context holds at least this many keys: fewer would not pay for the
# combine's extra reads and launch.
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 64
PROGRAMS_PER_PROCESSOR = 2  # enough programs in flight per SM for a memory-bound walk (H200 sweep)


def choose_splits(programs: int, visible: int, processors: int) -> int:
    """Parts to split each context into, so the launch has enough programs for the GPU: 1 when
    the batch's own (sequence x KV head x head block) are enough or the context is short."""
    wanted = PROGRAMS_PER_PROCESSOR * processors
    if programs >= wanted:
        return 1
    return max(1, min(cdiv(wanted, programs), visible // SPLIT_MIN_KEYS, MAX_SPLITS))


@functools.cache
def processor_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (a pretend 4 for the interpreter's CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def kernel_constants(heads: int, kv_heads: int, head_dim: int, v_dim: int, page: int, *, sinks: bool, window: bool,
                     dtype: torch.dtype, split: bool = False) -> dict:
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
        SPLIT=split,
    )


def launch_warps(constants: dict) -> int:
    return 4 if constants["BLOCK_D"] <= 256 else 8  # MLA's latents: more threads for the wider tiles


def paged_decode_triton(q, k_cache, v_cache, tables, lens, rows, out, *, page: int, scale: float,
                        window: int | None = None, sinks: torch.Tensor | None = None,
                        max_context: int | None = None, splits: int | None = None) -> None:
    """Decode attention into out[rows] (out [T, H, Dv]): q [T, H, D]; k_cache [slots, KVH, D],
    v_cache [slots, KVH, Dv]; per decoding sequence its block table row (tables [B, max_blocks]),
    context length (lens [B], this token included) and row in q (rows [B]). max_context: the
    longest of lens (known on the host), from which `splits` (parts per context) is chosen
    unless given; neither given: no split."""
    num_seqs, heads, kv_heads = rows.shape[0], q.shape[1], k_cache.shape[1]
    if num_seqs == 0:
        return
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if out.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("out and the caches must be contiguous in their last dim")
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernel steps through a head's dims one by one
    v_dim = v_cache.shape[2]
    head_blocks = cdiv(heads // kv_heads, MIN_DOT)
    if splits is None:
        visible = 0 if max_context is None else min(max_context, window or max_context)
        splits = choose_splits(num_seqs * kv_heads * head_blocks, visible, processor_count(q.device))
    constants = kernel_constants(heads, kv_heads, q.shape[2], v_dim, page, sinks=sinks is not None,
                                 window=window is not None, dtype=q.dtype, split=splits > 1)
    parts = part_acc = q  # unused without a split
    if splits > 1:
        parts = torch.empty((num_seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((num_seqs, heads, splits, v_dim), dtype=torch.float32, device=q.device)
    sink_arg = sinks if sinks is not None else q
    _paged_decode_kernel[(num_seqs, kv_heads, head_blocks * splits)](
        q, k_cache, v_cache, tables, lens, rows, sink_arg, out, parts, part_acc,
        float(scale), int(window or 0), splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), out.stride(0), out.stride(1),
        **constants, num_warps=launch_warps(constants),
        enable_fp_fusion=True,  # pinned (Triton 3.9 warns its default will change)
    )
    if splits > 1:
        _combine_splits_kernel[(num_seqs, heads)](
            parts, part_acc, rows, sink_arg, out, splits, out.stride(0), out.stride(1),
            V_DIM=v_dim, BLOCK_DV=constants["BLOCK_DV"], BLOCK_S=next_power_of_2(splits), HAS_SINKS=sinks is not None,
            num_warps=4, enable_fp_fusion=True,
        )


__all__ = ["choose_splits", "interpreter_enabled", "kernel_constants", "launch_warps", "paged_decode_triton"]
