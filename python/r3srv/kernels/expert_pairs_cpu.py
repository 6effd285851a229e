"""The CPU expert pass in one call into the Rust core (rust/src/expert_pairs.rs), at every
batch size: the pairs grouped by expert, both projections of each expert's pairs as one small
matrix product that reads each weight row once, the activation, the biases and the weighted
sum per token, reading the experts' weights in place, on up to settings.cpu_threads threads.
It replaces models/moe.py's torch paths: two `torch.mv` and several indexing ops per pair for a
few pairs (dispatch cost as large as the products' memory traffic), and the sort, gather,
grouped GEMMs and scatter of larger batches (each a full pass over memory).
An expert with many pairs (a prefill's) runs them through packed matrix kernels instead
(rust/src/matmul.rs), within float32 rounding of the small products; below that a token's
result does not depend on the other tokens in the call, and the thread count never does.

float32 or bfloat16 tensors (float32 arithmetic either way: a bfloat16 result is rounded
once, where the torch path rounds every intermediate), and only the activations moe.py defines
(SwiGLU, gpt-oss's clamped SwiGLU, Nemotron-H's relu^2); anything else returns None and the
caller keeps its torch path, as does `--no-cpu-expert-kernel` (R3SRV_CPU_EXPERT_KERNEL=0).
The products and the sum over a token's slots run in another order than torch's, so results
differ from the torch path by rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from r3srv import settings
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

_expert_pairs_cpu = rust_kernel("expert_pairs_cpu")
BUILT = _expert_pairs_cpu is not None  # else the torch path (kernels/rust_core.py)


def expert_pairs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tokens: torch.Tensor | None,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """sum over pairs p of token t: weights[p] * expert_{ids[p]}(x[t]) (as moe.grouped_experts:
    every token's k slots, ids/weights [T, k], or the pairs (tokens[p], ids[p], weights[p])
    [P]) through the Rust kernel, or None where it does not apply: the setting is off, x and
    the experts are not contiguous CPU tensors of one dtype the kernel reads, or `act` is not
    one of moe.py's activations."""
    dtype = RUST_DTYPES.get(x.dtype)
    if not BUILT or not settings.current().cpu_expert_kernel or dtype is None or not x.is_cpu:
        return None
    spec = _activation(act)
    if spec is None:
        return None
    name, alpha, limit = spec
    num_experts, hidden, inter = w2.shape
    rows13 = inter * (1 if name == "relu_squared" else 2)
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
    _expert_pairs_cpu(addresses, shape, dtype, name, alpha, limit, settings.current().cpu_threads)
    return out


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` contiguous in `dtype` (no copy when it already is)."""
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


@functools.lru_cache(maxsize=256)
def _activation(act: Callable) -> tuple[str, float, float] | None:
    """(name, alpha, limit) of the Rust activation equal to `act`, or None."""
    from r3srv.models import moe  # moe imports this module

    if act is moe.silu_and_mul:
        return "silu_and_mul", 0.0, 0.0
    if act is moe.relu_squared:
        return "relu_squared", 0.0, 0.0
    if isinstance(act, functools.partial) and act.func is moe.clamped_swiglu and not act.args \
            and set(act.keywords) == {"alpha", "limit"}:
        return "clamped_swiglu", float(act.keywords["alpha"]), float(act.keywords["limit"])
    return None
