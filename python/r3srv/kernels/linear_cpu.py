"""Linear layers of a few rows on the CPU through the Rust core (rust/src/linear.rs): a decode
step's projections (q/k/v, output, router gate, LM head) in one call each that reads the
weight once, row by row, instead of torch's GEMM call, whose per-call cost and cache-cold
weight reads dominate at one to a few rows (docs/benchmarks.md).

`linear_rust` takes contiguous float32 or bfloat16 CPU tensors of one dtype with at most
`row_limit` rows (MAX_ROWS; FLOAT32_MAX_ROWS for a float32 weight; PACKED_MAX_ROWS where the
weight is read packed, below) and returns None otherwise (the CPU backend, ops/cpu.py, then
calls F.linear; it takes torch's always with `--no-rust-linear`, R3SRV_RUST_LINEAR=0, or without
a built extension). Results differ from torch's by rounding (another order of the same sums;
float32 arithmetic for bfloat16, rounded once), and a row's result does not depend on the other
rows.

bfloat16 with more rows (a prefill's projections) takes the kernel's packed path too where
torch has no fast bfloat16 GEMM: on a CPU without AMX or AVX-512 BF16 torch runs bfloat16 at
about a sixth of its float32 speed, and the kernel widens each block of the weight to float32
and runs float32's packed products (benches/bench_linear_cpu.py). With AMX or AVX-512 BF16
(what /proc/cpuinfo reports, read once) torch's oneDNN kernels keep those calls.

float32 with more rows takes the kernel where the CPU runs its row tiles (AVX-512F,
rust/src/row_tiles.rs): x's rows read in place against each 64 outputs' weights packed once a
part, where torch's GEMM packs both operands every call, a large share of a prefill's
projections of K = 256 (docs/benchmarks.md, "Prefill projections in row tiles"), from
ROW_TILES_MIN_ROWS rows. Each element is one fused multiply-add chain over K in order.

With `pack`, a bfloat16 weight that is a parameter is read from its packed copy
(kernels/packed_weights.py: the 64-output panels of pairs the expert pass reads bfloat16 experts
in, one contiguous run each) where the CPU runs those products (AVX-512 BF16 dot products that
are the wide expert chunks' products, not AMX tiles): a decode step's few rows then stream the
weight at the core's read rate and run in register blocks of 6 rows x 64 outputs, where the rows'
four-row blocks ended each output in a horizontal sum (docs/benchmarks.md, "Linear layers'
weights packed"). Each element is then the dot products' chain over the pairs in order, a row's
result still its own. float32 weights are not packed for this kernel: over a packed copy each
element would be one fused multiply-add chain over K, 2-2.5x the rounding error of `gemm_nt`'s
lanes at K >= 256 (bfloat16's own rounding hides the difference).
"""

from __future__ import annotations

import torch

from r3srv.kernels.cpu_isa import torch_has_fast_bfloat16
from r3srv.kernels.packed_weights import packed_address
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

linear_entry = rust_kernel("linear_cpu")
BUILT = linear_entry is not None  # else torch's F.linear (kernels/rust_core.py)

# More rows than this: torch's GEMM, whose packed kernels win once the weights are reused enough
# (bfloat16: the kernel's own packed path, where PACKED_BF16). The batch-invariant linear's blocks.
MAX_ROWS = 32
# A float32 weight takes the kernel's per-row products up to this many rows, the last below its
# many-row kernels (rust/src/linear.rs, PACKED_MIN_ROWS): decode steps of 33-63 sequences stay in
# the fused layers, where torch's GEMM per call cost more at two threads (docs/benchmarks.md,
# "Float32 decode steps of up to 63 sequences").
FLOAT32_MAX_ROWS = 63
# A weight read from its packed copy (bfloat16: see below) takes the kernel up to this many rows:
# a decode step of the default max_num_seqs (64) stays in the fused layers; from 128 rows torch's
# oneDNN GEMM was as fast at two threads (docs/benchmarks.md, "Linear layers' weights packed").
PACKED_MAX_ROWS = 64
# Whether bfloat16 products of more than MAX_ROWS rows run in the kernel (see the docstring).
PACKED_BF16 = not torch_has_fast_bfloat16()
# Whether float32 products of ROW_TILES_MIN_ROWS rows or more run in the kernel: its row tiles
# run here. Below, torch's GEMM on two threads kept up (docs/benchmarks.md).
_row_tiles = rust_kernel("linear_row_tiles")
PACKED_F32 = bool(_row_tiles and _row_tiles())
ROW_TILES_MIN_ROWS = 1024


def linear_rust(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                threads: int = 1, pack: bool = False) -> torch.Tensor | None:
    """x @ weight.T (+ bias) through the Rust kernel on up to `threads` threads, or None where it
    does not apply; `pack`: a bfloat16 parameter read from its packed copy (`packed_weight`). A
    decode step makes a dozen of these calls: the checks read each attribute once, cheapest
    first."""
    dtype = RUST_DTYPES.get(x.dtype)
    if dtype is None or not BUILT or not x.is_cpu:
        return None
    shape, weight_shape = x.shape, weight.shape
    if len(weight_shape) != 2 or not shape:
        return None
    out_features, in_features = weight_shape
    if shape[-1] != in_features or in_features == 0 or out_features == 0:
        return None
    rows = x.numel() // in_features
    if rows <= 0 or x.requires_grad or weight.requires_grad:
        return None
    packed = packed_weight(weight, threads) if pack else None
    if rows > MAX_ROWS and rows > row_limit(packed, x.dtype) and not (PACKED_BF16 if dtype == "bfloat16" else
                                                                    PACKED_F32 and rows >= ROW_TILES_MIN_ROWS):
        return None
    if weight.dtype != x.dtype or not weight.is_cpu or not x.is_contiguous() or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_cpu or not bias.is_contiguous()
                             or bias.shape != (out_features,)):
        return None
    out = x.new_empty(rows, out_features) if len(shape) == 2 else x.new_empty(*shape[:-1], out_features)
    addresses = (x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr())
    linear_entry(addresses, (rows, out_features, in_features), dtype, threads, None, packed)
    return out


def row_limit(packed: int | None, dtype: torch.dtype) -> int:
    """The most rows the kernel takes of a weight of `dtype` read from the packed copy at `packed`
    (None: read in place), below the many-row paths, at least MAX_ROWS: the one rule the backend's
    op and the fused decode layer (ops/cpu_decode.py) both follow."""
    if packed is not None:
        return PACKED_MAX_ROWS
    return FLOAT32_MAX_ROWS if dtype == torch.float32 else MAX_ROWS


def packed_weight(weight: torch.Tensor, threads: int = 1) -> int | None:
    """The address of `weight`'s packed copy where this kernel reads one (a bfloat16 parameter on
    a CPU that runs the packed products: see the module docstring), else None: the one rule the
    backend's op and the fused decode layer (ops/cpu_decode.py) both follow."""
    return packed_address(weight, threads) if weight.dtype is torch.bfloat16 else None
