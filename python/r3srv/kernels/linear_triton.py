"""A linear layer in Triton whose every output row is computed the same way at any row count:
the batch-invariant CUDA backend's (ops/invariant.py). cuBLAS picks its tiles, split-K and
reduction order by the shape of the call, so a token's row changes with the batch; here one
program per 16 x 32 tile of the output walks the inputs' dim in fixed steps of 16, each step's
products summed per output element and accumulated in float32 in the same order for every row,
whatever M is. Not tl.dot: its tiles may order a row's sum by the row's place in the tile (the
interpreter's numpy matmul does), which a check in the interpreter could not tell apart from
the device's. Plain FMA arithmetic, slower than tensor cores: the price of the mode on a GPU,
not yet measured there.

The same source runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors in Triton's
interpreter (tests/batch_invariant_triton_cases.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3srv.kernels.launch import cdiv

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 16  # fixed: never chosen by the shape


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        # products and a sum over this step's K for each output element alone: the same tree for
        # every element (tl.dot's tiles may order a row's sum by its place in the tile)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract (x [..., K], weight [N, K], bias [N]), each row alike at any row count."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = rows.new_empty(m, n)
    if m and n:
        _linear_kernel[(cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))](
            rows, weight, bias if bias is not None else weight, out, m, n, k, rows.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )
    return out.view(*x.shape[:-1], n)
