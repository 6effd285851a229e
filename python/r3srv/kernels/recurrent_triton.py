"""Fused Triton decode steps of the recurrent layers: the delta rules (Gated DeltaNet, Kimi
Delta Attention) and Mamba-2's state-space step.

The torch step (models/gated_deltanet.py's recurrent_step, models/kda.py's kda_step) gathers
each decoding sequence's float32 state out of the pool, updates the copy and scatters it back:
three passes over the largest tensors of a decode step. This kernel reads each state where
it lies (the sequence's slot), decays it, writes the token, reads the output and stores the
state back in place: one pass. A program owns one (sequence, head, block of value columns):
the delta rule treats value columns independently, so programs never share a state element
(Mamba-2's step: one per sequence, head and 16 rows of its head_dim x state_size state).

The same source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in Triton's
interpreter (how tests/recurrent_triton_cases.py checks it against the torch step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from r3srv.kernels.launch import cdiv, next_power_of_2

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
    grid = (rows, heads, cdiv(dv, BLOCK_V))
    _delta_rule_step_kernel[grid](
        pool, slots.contiguous(), keep.float().contiguous(), q, k, v, g, beta, out,
        heads, dk, dv,
        *pool.stride(),
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), g_stride_k,
        beta.stride(0), out.stride(0), out.stride(1),
        BLOCK_K=next_power_of_2(dk), BLOCK_V=BLOCK_V, num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-adds: the torch step's rounding, as the router kernel
    )
    return out




@triton.jit
def _ssm_step_kernel(
    state_ptr, slots_ptr, keep_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, out_ptr,
    head_dim, state_size,
    stride_se, stride_sh, stride_sp, stride_sn,
    stride_xt, stride_xh, stride_dt, stride_bt, stride_bh, stride_ot, stride_oh,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    p_ok, n_ok = ps < head_dim, ns < state_size
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = tl.load(keep_ptr + row)
    tile = state_ptr + slot * stride_se + head * stride_sh + ps[:, None] * stride_sp + ns[None, :] * stride_sn
    mask = p_ok[:, None] & n_ok[None, :]
    s = tl.load(tile, mask=mask, other=0.0) * keep
    dt = tl.load(dt_ptr + row * stride_dt + head).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    x = tl.load(x_ptr + row * stride_xt + head * stride_xh + ps, mask=p_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + head * stride_bh + ns, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_bt + head * stride_bh + ns, mask=n_ok, other=0.0).to(tl.float32)
    s = s * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
    tl.store(tile, s, mask=mask)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + ps, tl.sum(s * c[None, :], axis=1), mask=p_ok)


BLOCK_P = 16  # head_dim rows per program of the state-space step


def ssm_step_triton(pool, slots, keep, x, dt, b, c, a) -> torch.Tensor:
    """Mamba-2's one-token step (models/mamba2.py's ssm_step), states updated in place in their
    pool slots. pool [entries, H, P, N] float32; slots [B]; keep [B]; x [B, H, P]; dt [B, H];
    b, c [B, H, N]; a [H]. Returns y [B, H, P] float32 (without the D skip)."""
    if pool.dtype != torch.float32 or pool.dim() != 4:
        raise ValueError(f"the state pool must be [entries, heads, P, N] float32, got {tuple(pool.shape)} {pool.dtype}")
    rows, heads, head_dim = x.shape
    state_size = b.shape[-1]
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    x, dt, a, b, c = (t.float().contiguous() for t in (x, dt, a, b, c))
    grid = (rows, heads, cdiv(head_dim, BLOCK_P))
    _ssm_step_kernel[grid](
        pool, slots.contiguous(), keep.float().contiguous(), x, dt, a, b, c, out,
        head_dim, state_size,
        *pool.stride(),
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BLOCK_P=BLOCK_P, BLOCK_N=next_power_of_2(state_size), num_warps=4, enable_fp_fusion=False,
    )
    return out


__all__ = ["BLOCK_P", "BLOCK_V", "delta_rule_step_triton", "interpreter_enabled", "ssm_step_triton"]
