"""The CPU expert pass in one call into the Rust core (rust/src/expert_pairs.rs), at every
batch size: the pairs grouped by expert, both projections of each expert's pairs as one small
matrix product that reads each weight row once, the activation, the biases and the weighted
sum per token, reading the experts' weights in place, on up to the given threads.
It replaces ops/experts.py's torch paths: two `torch.mv` and several indexing ops per pair for a
few pairs (dispatch cost as large as the products' memory traffic), and the sort, gather,
grouped GEMMs and scatter of larger batches (each a full pass over memory).
An expert with many pairs (a prefill's) runs them in wide chunks instead, within float32
rounding of the small products: float32 experts with the pairs as the vector lanes
(rust/src/pair_panels.rs) on an AVX2 or AVX-512 CPU, others through packed matrix kernels
(rust/src/matmul.rs, rust/src/matmul_bf16.rs); below that a token's
result does not depend on the other tokens in the call, and the thread count never does.
On an AVX-512 CPU the backend's pass reads float32 experts from a copy packed in row tiles
(`packed_experts`, kernels/packed_weights.py, rust/src/row_tiles.rs), and where the AVX-512
BF16 dot products are the wide chunks' products (not AMX tiles) bfloat16 experts from a copy in
their panels (rust/src/matmul_bf16.rs): every chunk with the wide chunks' bits.

float32 or bfloat16 tensors (float32 arithmetic either way: a bfloat16 result is rounded
once, where the torch path rounds every intermediate), and only the activations ops/experts.py
defines (SwiGLU, gpt-oss's clamped SwiGLU, Nemotron-H's relu^2); anything else returns None and
the caller keeps its torch path. The CPU backend (ops/cpu.py) takes it unless
`--no-cpu-expert-kernel` (R3SRV_CPU_EXPERT_KERNEL=0).
The products and the sum over a token's slots run in another order than torch's, so results
differ from the torch path by rounding.
"""

from __future__ import annotations

import torch

from r3srv.kernels.packed_weights import packed_copy, packs
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

expert_pairs_entry = rust_kernel("expert_pairs_cpu")
_wide_min_pairs = rust_kernel("expert_pairs_wide_min_pairs")
_allow_amx = rust_kernel("expert_pairs_allow_amx")
_bf16_products = rust_kernel("expert_pairs_bf16_products")
BUILT = expert_pairs_entry is not None  # else the torch path (kernels/rust_core.py)
ACTIVATIONS = ("silu_and_mul", "relu_squared", "clamped_swiglu")  # what the kernel computes


def expert_pairs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tokens: torch.Tensor | None,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act,
    threads: int = 1,
    wide_min_pairs: int | None = None,
    pack: bool = False,
) -> torch.Tensor | None:
    """sum over pairs p of token t: weights[p] * expert_{ids[p]}(x[t]) (ops/experts.py's pass:
    every token's k slots, ids/weights [T, k], or the pairs (tokens[p], ids[p], weights[p])
    [P]) through the Rust kernel on up to `threads` threads, an expert's pairs in wide chunks from
    `wide_min_pairs` on (None: the kernel's threshold, `wide_min_pairs()`), or None where it does
    not apply:
    x and the experts are not contiguous CPU tensors of one dtype the kernel reads, or `act`
    (an activation described by .name, .alpha and .limit) is not one the kernel computes.
    `pack`: experts that are parameters are read from their packed copy (`packed_experts`)
    where the CPU runs its kernel."""
    dtype = RUST_DTYPES.get(x.dtype)
    if not BUILT or dtype is None or not x.is_cpu or getattr(act, "name", None) not in ACTIVATIONS:
        return None
    num_experts, hidden, inter = w2.shape
    rows13 = inter * (1 if act.name == "relu_squared" else 2)
    if w13.shape != (num_experts, rows13, hidden) or x.shape[-1] != hidden:
        return None
    for w in (w13, w2, b13, b2):
        if w is not None and (w.dtype != x.dtype or not w.is_cpu or not w.is_contiguous()):
            return None
    x, ids, weights = x.contiguous(), _as(ids, torch.int32), _as(weights, torch.float32)
    tokens = None if tokens is None else _as(tokens, torch.int32)
    out = torch.empty_like(x)
    addresses = (x.data_ptr(), w13.data_ptr(), w2.data_ptr(), 0 if b13 is None else b13.data_ptr(),
                 0 if b2 is None else b2.data_ptr(), 0 if tokens is None else tokens.data_ptr(),
                 ids.data_ptr(), weights.data_ptr(), out.data_ptr())
    shape = (x.shape[0], ids.numel(), num_experts, hidden, inter)
    expert_pairs_entry(addresses, shape, dtype, act.name, float(act.alpha), float(act.limit), threads, wide_min_pairs,
                       packed_addresses(w13, w2, threads) if pack else None)
    return out


def packed_experts(w13: torch.Tensor, w2: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Experts' weights w13 [E, R, H] and w2 [E, H, I] packed in 64-output blocks
    (kernels/packed_weights.py), each of which every chunk of the kernel's pass reads as one
    contiguous run: float32 weights in row tiles, in which a prefill's wide chunks need no
    transposes either (docs/benchmarks.md, "Float32 experts packed in row tiles"), bfloat16
    weights in the panels of pairs a wide chunk packs every call ("Bfloat16 experts packed in
    panels"). None where the CPU does not run their kernel (`packs`), the weights are not float32
    or bfloat16 parameters of one dtype, or the host lacks the memory (then the weights' rows are
    read in place)."""
    if w13.dtype != w2.dtype or w13.dim() != 3 or w2.dim() != 3:
        return None
    p13, p2 = packed_copy(w13, threads), packed_copy(w2, threads)
    return None if p13 is None or p2 is None else (p13, p2)


def packed_addresses(w13: torch.Tensor, w2: torch.Tensor, threads: int = 1) -> tuple[int, int] | None:
    """The data addresses of `packed_experts`' copy, the kernel entry's `packed` argument (None:
    no copy, the weights' rows read in place)."""
    packed = packed_experts(w13, w2, threads)
    return None if packed is None else (packed[0].data_ptr(), packed[1].data_ptr())


def wide_min_pairs(dtype: torch.dtype) -> int | None:
    """The pair count from which the kernel, unless told otherwise, runs an expert's pairs of
    `dtype` in wide chunks (whose bits differ from the narrow ones'): 16 for float32 where the
    CPU runs the pair panels and for bfloat16 where it runs AMX tiles (`allow_amx`), else 64
    (rust/src/expert_pairs.rs's wide_min_pairs); None where the kernel takes no such experts."""
    if _wide_min_pairs is None or dtype not in RUST_DTYPES:
        return None
    return _wide_min_pairs(RUST_DTYPES[dtype])


def allow_amx(allowed: bool) -> None:
    """Whether the Rust core may run bfloat16 in AMX tiles where the CPU has them: the experts'
    wide chunks (a prefill's) and the flash prefill attention (settings.amx_tiles; the CPU
    backend says so when it builds a model's ops): process-wide."""
    if _allow_amx is not None:
        _allow_amx(allowed)
        packs.cache_clear()  # bfloat16 weights are read packed only where AMX tiles are not chosen


def bf16_products() -> str | None:
    """What bfloat16 experts' wide chunks run in now: "amx", "avx512_bf16" or "float32" (None:
    no kernel)."""
    return None if _bf16_products is None else _bf16_products()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` contiguous in `dtype` (no copy when it already is)."""
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()
