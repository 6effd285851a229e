"""CPU weights kept packed beside their parameters, in the 64-output blocks the Rust core's
products read as one contiguous run each (a core streams a block at its full read bandwidth; a
matrix's own rows, four at a time, it did not): float32 weights in row tiles (AVX-512F,
rust/src/row_tiles.rs), bfloat16 ones in the AVX-512 BF16 dot products' panels of pairs where
those are the products a wide expert chunk takes (not AMX tiles; rust/src/matmul_bf16.rs). The
expert pass reads experts so (kernels/expert_pairs_cpu.py), the linear kernel bfloat16 layers'
weights (kernels/linear_cpu.py), each with the packed products' bits.

A copy is made on first use (twice the weight's memory; not made where it would take more than
half the host's available memory, then the weight's rows are read in place), packed again (into
the same copy) whenever the parameter's data moved or changed in place (a weight update: its
version counter), dropped with the parameter.
"""

from __future__ import annotations

import functools
import weakref

import torch

from r3srv import huge_pages
from r3srv.host_memory import available_bytes
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

_packed_runs = rust_kernel("expert_pairs_packed_runs")
_packed_len = rust_kernel("expert_pairs_packed_len")
_pack = rust_kernel("expert_pairs_pack")

# the packed copy's element type, by the weights' dtype (bfloat16 pairs as 32-bit values)
PACKED_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.int32}


@functools.cache
def packs(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels read weights of `dtype` packed on this CPU now: float32 ones in row
    tiles (AVX-512F), bfloat16 ones in panels (AVX-512 BF16, AMX tiles not allowed or absent).
    Asked of the core once (every decode layer's calls ask here; expert_pairs_cpu.allow_amx
    asks again)."""
    return _packed_runs is not None and dtype in PACKED_DTYPES and _packed_runs(RUST_DTYPES[dtype])


# id(parameter) -> (a weak reference to it, its data address and version when packed, the packed copy or None)
_PACKED: dict[int, tuple[weakref.ref, int, int, torch.Tensor | None]] = {}


def packed_copy(w: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
    """The packed copy of `w`, a contiguous float32 or bfloat16 CPU parameter of matrices [n, k]
    or a stack of them [E, n, k] (each packed alone), or None where the CPU does not run the
    packed products for its dtype (`packs`), `w` is not such a parameter, or the host lacks the
    memory."""
    key = id(w)
    kept = _PACKED.get(key)  # first: every decode step's projections and experts ask (a few per layer)
    if kept is not None and kept[0]() is w and kept[1] == w.data_ptr() and kept[2] == w._version and packs(w.dtype):
        return kept[3]
    if not (isinstance(w, torch.nn.Parameter) and w.dim() in (2, 3) and packs(w.dtype) and w.is_cpu
            and w.is_contiguous()):
        return None
    experts, n, k = w.shape if w.dim() == 3 else (1, *w.shape)
    dtype, code = PACKED_DTYPES[w.dtype], RUST_DTYPES[w.dtype]
    size = experts * _packed_len(code, n, k)
    earlier = kept[3] if kept is not None and kept[0]() is w else None
    if earlier is not None and earlier.dtype == dtype and earlier.numel() == size:
        # the parameter updated or moved (a trainer's every push): packed again into the copy it
        # has, whose pages are in, with no second copy held meanwhile (docs/benchmarks.md)
        packed = earlier
    elif 2 * size * dtype.itemsize > available_bytes():  # the answer kept, as a copy is, until the parameter changes
        packed = None
    else:
        packed = torch.empty(size, dtype=dtype)
        huge_pages.advise([packed])  # before the pack faults its pages in (the weights' own have them)
    if packed is not None:
        _pack(w.data_ptr(), packed.data_ptr(), (experts, n, k), code, threads)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if key in _PACKED and _PACKED[key][0] is ref:
            del _PACKED[key]

    _PACKED[key] = (weakref.ref(w, forget), w.data_ptr(), w._version, packed)
    return packed


def packed_address(w: torch.Tensor, threads: int = 1) -> int | None:
    """The data address of `w`'s packed copy (`packed_copy`), a kernel entry's `packed`
    argument; None: no copy, the weight's rows read in place."""
    packed = packed_copy(w, threads)
    return None if packed is None else packed.data_ptr()
