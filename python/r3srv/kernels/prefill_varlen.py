"""Prefill attention on CUDA through torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`): a step's whole prompts packed into one call, their
keys and values this step's own (a whole prompt's context is itself: no cached keys, so the
causal mask needs no alignment between query and key lengths).

The kernel is flash attention's: float16 or bfloat16, keys and values of the queries' head
dim, no sinks. Spans it does not take (chunks after cached tokens, sinks, other dtypes or
shapes) go to the torch path, in the same op call. Not yet run on a GPU: off by default
(`--varlen-prefill`), and benches/gpu_check.sh runs its device test.
"""

from __future__ import annotations

import itertools

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def available() -> bool:
    """Whether this torch has the varlen attention API (it runs on CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_prefill(other):
    """The prefill op (ops/attention.py's PrefillKernel) with a step's whole prompts through
    varlen_attn in one call and every other span through `other`."""
    from torch.nn.attention.varlen import varlen_attn

    def prefill(q, k, v, k_cache, v_cache, spans, out, *, scale=None, window=None, sinks=None) -> None:
        fits = sinks is None and q.is_cuda and q.dtype in FLASH_DTYPES and k.shape[-1] == v.shape[-1] == q.shape[-1]
        whole = [s for s in spans if s.context_slots is None] if fits else []
        if len(whole) < len(spans):
            taken = {id(s) for s in whole}
            other(q, k, v, k_cache, v_cache, [s for s in spans if id(s) not in taken], out, scale=scale,
                  window=window, sinks=sinks)
        if not whole:
            return
        rows = torch.cat([torch.arange(s.start, s.end, device=q.device) for s in whole])
        lens = [s.end - s.start for s in whole]
        cumulative = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=q.device)
        attended = varlen_attn(q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), cumulative,
                               cumulative, max(lens), max(lens), scale=scale,
                               window_size=(-1 if window is None else window - 1, 0),
                               enable_gqa=q.shape[1] != k.shape[1])
        out.index_copy_(0, rows, attended)

    return prefill


__all__ = ["available", "varlen_prefill"]
