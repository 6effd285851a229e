"""Fused Triton decode step of the delta-rule layers (Gated DeltaNet, Kimi Delta Attention).

The torch step (models/gated_deltanet.py's recurrent_step, models/kda.py's kda_step) gathers
each decoding sequence's float32 state out of the pool, updates the copy and scatters it back:
three passes over the largest tensors of a decode step. This kernel reads each state where
it lies (the sequence's slot), decays it, writes the token, reads the output and stores the
state back in place: one pass. A program owns one (sequence, head, block of value columns):
the delta rule treats value columns independently, so programs never share a state element.

The same source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in Triton's
interpreter (how tests/delta_rule_triton_cases.py checks it against the torch step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_V = 32  # value columns per program: dk x 32 float32 in registers


@triton.jit
def _delta_rule_step_kernel(
    state_ptr, slots_ptr, keep_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    num_heads, dk, dv,
    stride_se, stride_sh, stride_sk, stride_sv,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_gh, stride_gk, stride_bt, stride_ot, stride_oh,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    k_ok, v_ok = ks < dk, cols < dv
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = tl.load(keep_ptr + row)  # 0: the sequence starts here, from a zero state
    tile = state_ptr + slot * stride_se + head * stride_sh + ks[:, None] * stride_sk + cols[None, :] * stride_sv
    mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * keep
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_qt + head * stride_qh + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + cols, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + head * stride_gh + ks * stride_gk, mask=k_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_bt + head).to(tl.float32)
    s = s * tl.exp(g)[:, None]
    u = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    tl.store(tile, s, mask=mask)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + cols, tl.sum(s * q[:, None], axis=0), mask=v_ok)


def interpreter_enabled() -> bool:
    """True when this process imported triton with TRITON_INTERPRET=1 (CPU tensors only)."""
    return isinstance(_delta_rule_step_kernel, InterpretedFunction)


def delta_rule_step_triton(pool, slots, keep, q, k, v, g, beta) -> torch.Tensor:
    """One token per sequence, states updated in place in their pool slots.

    pool [entries, H, dk, dv] float32; slots [B] long; keep [B] float (0: start from zeros);
    q, k [B, H, dk] (q scaled); v [B, H, dv]; g [B, H] (a decay per head) or [B, H, dk] (per key
    channel); beta [B, H]. Returns o [B, H, dv] float32, as the torch steps do."""
    if pool.dtype != torch.float32 or pool.dim() != 4:
        raise ValueError(f"the state pool must be [entries, heads, dk, dv] float32, got {tuple(pool.shape)} {pool.dtype}")
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    q, k, v, beta = (x.float().contiguous() for x in (q, k, v, beta))
    g = g.float()
    g_stride_k = 0 if g.dim() == 2 else g.stride(2)  # a decay per head reads the same value for every channel
    grid = (rows, heads, triton.cdiv(dv, BLOCK_V))
    _delta_rule_step_kernel[grid](
        pool, slots.contiguous(), keep.float().contiguous(), q, k, v, g, beta, out,
        heads, dk, dv,
        *pool.stride(),
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), g_stride_k,
        beta.stride(0), out.stride(0), out.stride(1),
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-adds: the torch step's rounding, as the router kernel
    )
    return out


__all__ = ["BLOCK_V", "delta_rule_step_triton", "interpreter_enabled"]
