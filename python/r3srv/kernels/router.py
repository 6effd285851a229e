"""Expert selection entry point used by every MoE layer.

Dispatches to the fused Triton kernel on CUDA (when it is available), to the Rust kernel on
the CPU (kernels/router_cpu.py, where it applies) and to the plain-torch reference everywhere
else; all share `route_reference`'s signature and its ValueErrors.

Backends (the `backend` argument; None: "torch" when settings.force_torch_router, else "auto"):
  "auto"   Triton for CUDA tensors when triton imports, top_k <= 16, experts <= 1024 and
           expert groups <= 32; on the CPU the Rust kernel when settings.rust_router is on
           and router_cpu.route_cpu applies; torch otherwise.
  "torch"  always the torch reference.
  "triton" always the fused kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
           raises if it cannot run. For tests and benchmarks.
"""

from __future__ import annotations

import importlib.util

import torch

from r3srv import settings
from r3srv.kernels.router_cpu import route_cpu
from r3srv.kernels.router_reference import check_route_args, route_reference

BACKENDS = ("auto", "torch", "triton")
# router_triton's limits, without importing triton on CPU-only paths
_FUSED_MAX_TOP_K = 16
_FUSED_MAX_EXPERTS = 1024
_FUSED_MAX_GROUPS = 32

_triton_importable: bool | None = None


def triton_available() -> bool:
    global _triton_importable
    if _triton_importable is None:
        _triton_importable = importlib.util.find_spec("triton") is not None
    return _triton_importable


def _resolved(backend: str | None) -> str:
    """The backend a call runs: `backend`, or the settings' default for None."""
    if backend is None:
        return "torch" if settings.current().force_torch_router else "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown router backend {backend!r}; expected one of {BACKENDS}")
    return backend


def uses_triton(router_logits: torch.Tensor, top_k: int, num_groups: int = 1, backend: str | None = None) -> bool:
    """Whether `select_experts` would run the fused kernel for these inputs."""
    backend = _resolved(backend)
    if backend == "triton":
        if not triton_available():
            raise ValueError("router backend 'triton' needs the triton package, which is not importable")
        return True
    if backend == "torch":
        return False
    return (
        router_logits.is_cuda
        and num_groups <= _FUSED_MAX_GROUPS
        and top_k <= _FUSED_MAX_TOP_K
        and router_logits.shape[-1] <= _FUSED_MAX_EXPERTS
        and triton_available()
    )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    capture: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score_top: int = 2,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to its top-k experts; see `route_reference` for the contract."""
    backend = _resolved(backend)
    route = route_reference
    if backend == "auto" and router_logits.is_cpu:  # every CPU MoE layer of every step: the Rust kernel
        check_route_args(router_logits, top_k, scoring, correction_bias, capture, num_groups, topk_groups,
                         group_score_top)
        routed = route_cpu(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                           correction_bias=correction_bias, scaling=scaling, capture=capture, num_groups=num_groups)
        if routed is not None:
            return routed
    elif uses_triton(router_logits, top_k, num_groups, backend):
        from r3srv.kernels.router_triton import route_triton  # imports triton only when used

        route = route_triton
    return route(
        router_logits,
        top_k,
        scoring=scoring,
        renormalize=renormalize,
        correction_bias=correction_bias,
        scaling=scaling,
        capture=capture,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_score_top=group_score_top,
    )
