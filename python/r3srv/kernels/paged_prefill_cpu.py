"""Prefill attention on the CPU for a whole step, in the Rust core (rust/src/paged_prefill.rs):
every prompt and prompt chunk of the step attends causally over its context where it lies in
the paged cache, in one call.

The prefill op's semantics (GQA, MLA's values viewing the keys' leading dims, sliding windows,
sinks; ops/attention.py's `span_kernel` hands it a step's spans as arrays); the torch path calls SDPA once per
prompt over its keys or over its context gathered from the cache. This reads each context in
place, a block of a prompt's queries per key load, with an online softmax in float32, the work
split over the given threads. Without a window a query's row does not depend on how its prompt
was chunked or batched (the same bits). Without a window or sinks, a flash attention over keys
and values packed in blocks runs instead where the CPU has it (rust/src/flash_prefill.rs), at
any context length: bfloat16 in AMX tiles (where the CPU has them and settings.amx_tiles allows)
or AVX-512 BF16 dot products, float32 in AVX-512 FMA; where the CPU lacks AVX-512F, float32 in
AVX2 FMA for the contexts the portable kernel takes. Tensors cross as
data pointers, shapes and strides: this module checks what Rust cannot (dtypes, devices,
layouts, aliasing) and Rust checks every index before following it.
"""

from __future__ import annotations

import functools

import torch

from r3srv.kernels.paged_decode_cpu import as_index, checked_attention, head_major
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

paged_prefill_entry = rust_kernel("paged_prefill_attention")
BUILT = paged_prefill_entry is not None  # else the torch path (kernels/rust_core.py)
# the rule for the flash kernels (rust/src/paged_prefill_bf16.rs's and paged_prefill_f32.rs's
# applies_to: the CPU, no window, no sinks, an even head_dim in bfloat16), asked of Rust, which owns it
_flash = rust_kernel("paged_prefill_flash")
_flash_tiles = rust_kernel("paged_prefill_flash_tiles")
# the dtypes whose prefills this CPU runs in a flash kernel
FLASH = {name for name in ("float32", "bfloat16") if BUILT and _flash is not None and _flash(name, 2, False, False)}


def flash_applies(q: torch.Tensor, window: int | None, sinks: torch.Tensor | None) -> bool:
    """Whether the call runs in its dtype's flash kernel, which outruns SDPA at every context
    length (docs/benchmarks.md)."""
    name = RUST_DTYPES.get(q.dtype)
    return name in FLASH and _flash_rule(name, q.shape[-1], window is not None, sinks is not None)


@functools.cache
def _flash_rule(name: str, head_dim: int, windowed: bool, sinks: bool) -> bool:
    """Rust's answer for a layer's shape, asked once (every prefill step of every layer asks)."""
    return _flash(name, head_dim, windowed, sinks)


def flash_tiles(dtype: torch.dtype) -> str | None:
    """The tiles the dtype's flash kernel runs in now: "amx", "avx512" or "avx2" (None: no flash
    kernel here). AMX only while allowed (expert_pairs_cpu.allow_amx)."""
    name = RUST_DTYPES.get(dtype)
    return None if name not in FLASH or _flash_tiles is None else _flash_tiles(name)


def paged_prefill_cpu(q, k_cache, v_cache, columns, slots, out, *, scale: float, window: int | None = None,
                      sinks: torch.Tensor | None = None, threads: int = 1, kernel: str | None = None) -> None:
    """The prefill attention of every span into out's rows of it (out [T, H, Dv], contiguous):
    q [T, H, D]; k_cache [slots, KVH, D], v_cache [slots, KVH, Dv] with this step's keys and
    values written; columns [3, spans] (each span's first row in q, query count and context
    length, its queries the context's last); slots: the spans' context slots, span after span.
    threads: the work's split over the Rust core's thread pool (the CPU backend passes
    settings.cpu_threads). kernel: None (the fastest this CPU runs), or a narrower one named to
    measure it: "amx", "avx512" or "avx2" flash tiles (ValueError where this CPU lacks them for
    the dtype), "portable" (no flash)."""
    columns, slots = as_index(columns), as_index(slots)
    if columns.dim() != 2 or columns.shape[0] != 3 or slots.dim() != 1:
        raise ValueError(f"paged_prefill_cpu: columns {tuple(columns.shape)} must be [3, spans] and slots "
                         f"{tuple(slots.shape)} one-dimensional")
    if columns.shape[1] == 0:
        return
    sinks = checked_attention("paged_prefill_cpu", q, k_cache, v_cache, out, window, sinks)
    paged_prefill_entry(
        RUST_DTYPES[q.dtype], head_major("q", q), head_major("k_cache", k_cache), head_major("v_cache", v_cache),
        (columns.data_ptr(), columns.shape[1]), (slots.data_ptr(), slots.shape[0]), (out.data_ptr(), *out.shape),
        float(scale), window,
        None if sinks is None else sinks.data_ptr(), threads, kernel,
    )


__all__ = ["FLASH", "flash_applies", "flash_tiles", "paged_prefill_cpu"]
