"""The fused router on a real GPU: the CUDA backend gives a layer the kernel by itself, and it
agrees with the torch reference run on the CPU copy. Skipped (with the reason) without CUDA."""

from __future__ import annotations

import pytest
import torch

def cuda_route(shape):
    """The route function a CUDA model's layer of this RouterShape takes (force_torch_router off)."""
    from r3srv import settings
    from r3srv.kernels.router_triton import route_triton
    from r3srv.ops import ops_for

    with settings.overridden(force_torch_router=False):
        route = ops_for("cuda", torch.float32).router(shape)
    assert route is route_triton
    return route


pytestmark = pytest.mark.gpu("fused Triton router")


@pytest.mark.parametrize(
    "num_experts,top_k",
    [(e, k) for e in (8, 60, 128, 160, 256, 384, 512) for k in (1, 2, 6, 8, 10) if k <= e],  # 8 experts: no top-10
)
@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", True)])
def test_cuda_routing_matches_cpu_reference(num_experts, top_k, scoring, with_bias):
    from r3srv.kernels.router_reference import route_reference
    from r3srv.ops.router import RouterShape

    logits = torch.randn(1000, num_experts, device="cuda") * 2
    bias = torch.randn(num_experts, device="cuda") * 0.3 if with_bias else None
    dtype = torch.uint8 if num_experts <= 256 else torch.int32
    buffer = torch.full((1000, 4, top_k), 0x5A, dtype=dtype, device="cuda")
    route = cuda_route(RouterShape(num_experts, top_k, correction_bias=with_bias))
    weights, ids = route(logits, top_k, scoring=scoring, correction_bias=bias, capture=buffer[:, 2])
    want_w, want_ids = route_reference(
        logits.cpu(), top_k, scoring=scoring, correction_bias=None if bias is None else bias.cpu()
    )
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, atol=1e-6, rtol=0)
    assert torch.equal(buffer[:, 2].cpu().int(), want_ids)
    assert (buffer[:, [0, 1, 3]] == 0x5A).all()


@pytest.mark.parametrize(
    "num_experts,top_k,groups",
    [(256, 8, (8, 4, 2)), (160, 6, (8, 3, 1)), (384, 8, (32, 4, 2))],
    ids=["deepseek-v3", "deepseek-v2", "32-groups"],
)
def test_cuda_group_limited_routing_matches_cpu_reference(num_experts, top_k, groups):
    from r3srv.kernels.router_reference import route_reference
    from r3srv.ops.router import RouterShape

    num_groups, topk_groups, group_score_top = groups
    logits = torch.randn(1000, num_experts, device="cuda") * 2
    bias = torch.randn(num_experts, device="cuda") * 0.3 if group_score_top == 2 else None
    kwargs = dict(scoring="sigmoid" if bias is not None else "softmax", num_groups=num_groups,
                  topk_groups=topk_groups, group_score_top=group_score_top)
    route = cuda_route(RouterShape(num_experts, top_k, num_groups, correction_bias=bias is not None))
    weights, ids = route(logits, top_k, correction_bias=bias, **kwargs)
    want_w, want_ids = route_reference(logits.cpu(), top_k, correction_bias=None if bias is None else bias.cpu(), **kwargs)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, atol=1e-6, rtol=0)
