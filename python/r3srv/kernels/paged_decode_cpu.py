"""Paged decode attention on the CPU, in the Rust core (rust/src/paged_attn.rs): each decoding
sequence's query heads attend over its keys and values where they lie in the paged cache.

The CPU counterpart of kernels/paged_decode_triton.py, with its launcher's signature and
semantics (GQA, MLA's values viewing the keys' leading dims, sliding windows, sinks): the torch
path gathers every decode context into a padded copy and calls SDPA; this reads each context
once, in place, with an online softmax in float32 (bfloat16 caches accumulate in float32 too).
The work is split over sequences, and a long context's parts, across the given threads when
there is enough of it (rust/src/paged_attn.rs, PART_KEYS; a row's bits do not depend on the
thread count). Tensors cross as data pointers, shapes and strides: this module checks what Rust
cannot (dtypes, devices, layouts, aliasing) and Rust checks every index before following it.
"""

from __future__ import annotations

import torch

from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

paged_decode_entry = rust_kernel("paged_decode_attention")
BUILT = paged_decode_entry is not None  # else the torch path (kernels/rust_core.py)
# a decode step's new keys and values into the cache in one call (the fused decode layer,
# ops/cpu_decode.py; None in a build without it: torch's index_copy_)
write_kv_cache_entry = rust_kernel("write_kv_cache")


def supports(q: torch.Tensor) -> bool:
    """Whether decodes of queries like `q` can take this kernel (CPU, float32 or bfloat16)."""
    return BUILT and q.is_cpu and q.dtype in RUST_DTYPES


def head_major(name: str, t: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """A [rows, heads, dim] tensor, contiguous in its last dim, as (pointer, shape, strides)."""
    strides = t.stride()
    if len(strides) != 3 or (strides[2] != 1 and t.shape[2] > 1):
        raise ValueError(f"{name} must be [rows, heads, dim] and contiguous in its last dim, "
                         f"got shape {tuple(t.shape)} strides {strides}")
    return (t.data_ptr(), *t.shape, strides[0], strides[1])


def checked_attention(kernel: str, q, k_cache, v_cache, out, window: int | None,
                      sinks: torch.Tensor | None) -> torch.Tensor | None:
    """What Rust cannot check of an attention kernel's tensors (dtypes, devices, the output's
    layout, aliasing, the window, the sinks' shape); the sinks as the kernel reads them
    (float32, contiguous, on the CPU)."""
    if q.dtype not in RUST_DTYPES:
        raise TypeError(f"{kernel} takes float32 or bfloat16, not {q.dtype}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out}
    for name, t in tensors.items():
        if not t.is_cpu or t.dtype is not q.dtype:
            raise TypeError(f"{kernel}: {name} is {t.dtype} on {t.device}; every tensor must be {q.dtype} on the CPU")
    if not out.is_contiguous() or out.shape != (q.shape[0], q.shape[1], v_cache.shape[-1]):
        raise ValueError(f"{kernel}: out must be contiguous [{q.shape[0]}, {q.shape[1]}, {v_cache.shape[-1]}], "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")
    if window is not None and window < 1:
        raise ValueError(f"{kernel}: window must be positive, got {window}")
    written = out.untyped_storage().data_ptr()
    for name in ("q", "k_cache", "v_cache"):
        if tensors[name].untyped_storage().data_ptr() == written:
            raise ValueError(f"{kernel}: out shares memory with {name}")
    if sinks is None:
        return None
    sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"{kernel}: {tuple(sinks.shape)} sinks for {q.shape[1]} heads")
    return sinks


def as_index(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def paged_decode_cpu(q, k_cache, v_cache, tables, lens, rows, out, *, page: int, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     max_context: int | None = None, threads: int = 1) -> None:
    """Decode attention into out[rows] (out [T, H, Dv], contiguous): q [T, H, D]; k_cache
    [slots, KVH, D], v_cache [slots, KVH, Dv]; per decoding sequence its block table row
    (tables [B, max_blocks]), context length (lens [B], this token included) and row in q
    (rows [B]). max_context: accepted for the Triton launcher's signature (no split here).
    threads: the work's split over the Rust core's thread pool (the CPU backend passes
    settings.cpu_threads)."""
    del max_context
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    sinks = checked_attention("paged_decode_cpu", q, k_cache, v_cache, out, window, sinks)
    tables, lens, rows = as_index(tables), as_index(lens), as_index(rows)
    if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != rows.shape:
        raise ValueError(f"paged_decode_cpu: tables {tuple(tables.shape)}, lens {tuple(lens.shape)} and rows "
                         f"{tuple(rows.shape)} do not describe {num_seqs} sequences")
    paged_decode_entry(
        RUST_DTYPES[q.dtype], head_major("q", q), head_major("k_cache", k_cache), head_major("v_cache", v_cache),
        (tables.data_ptr(), *tables.shape), lens.data_ptr(), rows.data_ptr(), (out.data_ptr(), *out.shape),
        page, float(scale), window, None if sinks is None else sinks.data_ptr(), threads,
    )


__all__ = ["paged_decode_cpu", "supports"]
