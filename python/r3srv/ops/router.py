"""Expert selection: which kernel routes a MoE layer's tokens, chosen once per layer when the
model is built (`RouterChoice`). Every route function takes kernels/router_reference.py's
`route_reference` signature and raises its ValueErrors: (router_logits [T, E], top_k, *,
scoring, renormalize, correction_bias, scaling, capture, num_groups, topk_groups,
group_score_top) -> (weights float32 [T, k], ids int32 [T, k]), the ids also written into the
routed-experts capture view.

- CPU: the Rust kernel (kernels/router_cpu.py) for layers without a correction bias or expert
  groups, the reference where it declines a call (a capture view it cannot write);
- CUDA: the fused Triton kernel (kernels/router_triton.py) for layers within its limits;
- otherwise, and with `--force-torch-router`: the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from r3srv.kernels.router_reference import check_route_args, route_reference

RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# router_triton's limits, without importing triton on CPU-only paths (a test checks they agree)
FUSED_MAX_TOP_K = 16
FUSED_MAX_EXPERTS = 1024
FUSED_MAX_GROUPS = 32


@dataclass(frozen=True)
class RouterShape:
    """What decides a layer's routing kernel: its experts, top-k, groups and correction bias."""

    num_experts: int
    top_k: int
    num_groups: int = 1
    correction_bias: bool = False

    @property
    def fits_fused_kernel(self) -> bool:
        return (self.top_k <= FUSED_MAX_TOP_K and self.num_experts <= FUSED_MAX_EXPERTS
                and self.num_groups <= FUSED_MAX_GROUPS)


def kernel_router(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor] | None]) -> RouteFn:
    """`kernel` (route_reference's arguments but topk_groups and group_score_top; None where it
    declines), the reference where it declines; the arguments checked once, first."""

    def route(router_logits, top_k, *, scoring="softmax", renormalize=True, correction_bias=None, scaling=1.0,
              capture=None, num_groups=1, topk_groups=1, group_score_top=2):
        check_route_args(router_logits, top_k, scoring, correction_bias, capture, num_groups, topk_groups,
                         group_score_top)
        routed = kernel(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                        correction_bias=correction_bias, scaling=scaling, capture=capture, num_groups=num_groups)
        if routed is not None:
            return routed
        return route_reference(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                               correction_bias=correction_bias, scaling=scaling, capture=capture,
                               num_groups=num_groups, topk_groups=topk_groups, group_score_top=group_score_top)

    return route


RouterChoice = Callable[[RouterShape], RouteFn]  # a backend's router for one layer


def reference_router(shape: RouterShape) -> RouteFn:
    return route_reference
