"""Expert selection on the CPU in one call into the Rust core (rust/src/router_cpu.rs), where
`route_reference` takes about ten small torch ops per MoE layer, more than routing a decode
step's few rows costs (docs/benchmarks.md).

It covers the reference's common case: float32 or bfloat16 logits, contiguous, on the CPU, no
correction bias, one expert group; anything else returns None and the CPU backend's router
(ops/router.py) keeps the reference, as `--no-rust-router` (R3SRV_RUST_ROUTER=0) or a stale or
missing extension do. The ids (and the capture) are the reference's exactly: the experts are ranked by
the same float32 logits; the weights differ from torch's by rounding (another exp, another
order of summation).
"""

from __future__ import annotations

import torch

from r3srv.kernels.router_reference import _id_limit
from r3srv.kernels.rust_core import RUST_DTYPES, rust_kernel

route_experts_entry = rust_kernel("route_experts")
BUILT = route_experts_entry is not None  # else the reference (kernels/rust_core.py)


def route_cpu(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    capture: torch.Tensor | None = None,
    num_groups: int = 1,
    threads: int = 1,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`route_reference`'s (weights float32 [T, k], ids int32 [T, k]) through the Rust kernel (a
    prefill's rows split over up to `threads` threads), or None where it does not apply. Takes
    arguments `check_route_args` accepts (the router op checks them first); the kernel checks
    every length itself and raises ValueError."""
    dtype = RUST_DTYPES.get(router_logits.dtype)
    if not BUILT or dtype is None or correction_bias is not None or num_groups != 1:
        return None
    if not router_logits.is_cpu or router_logits.requires_grad:
        return None
    if router_logits.dim() != 2 or not router_logits.is_contiguous():
        return None
    tokens, experts = router_logits.shape
    target = None
    if capture is not None:
        if not capture_fits(capture, tokens, experts, top_k):
            return None
        target = (capture.data_ptr(), capture.stride(0), capture.element_size())
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int32)
    route_experts_entry(router_logits.data_ptr(), dtype, (tokens, experts, top_k), scoring, bool(renormalize), scaling,
                   weights.data_ptr(), ids.data_ptr(), target, threads)
    return weights, ids


def capture_fits(capture: torch.Tensor, tokens: int, experts: int, top_k: int) -> bool:
    """Whether the kernel can write the ids into `capture` as the reference's copy_ would: a
    [tokens, top_k] CPU integer view wide enough for the ids, its rows apart and each contiguous
    (one layer of a [tokens, layers, k] capture buffer is)."""
    if not capture.is_cpu or capture.dim() != 2 or tuple(capture.shape) != (tokens, top_k):
        return False
    limit = _id_limit(capture.dtype)
    if limit is None or limit < experts:
        return False
    return (top_k == 1 or capture.stride(1) == 1) and (tokens <= 1 or capture.stride(0) >= top_k)
