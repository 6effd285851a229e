"""Which route function each backend gives a MoE layer (in process, no GPU and no interpreter
needed: the CUDA backend is built here without a device, as a model on CUDA would build it)."""

from __future__ import annotations

import pytest
import torch

from r3srv import settings
from r3srv.kernels.router_reference import route_reference
from r3srv.ops import cpu, cuda
from r3srv.ops import router as router_ops
from r3srv.ops.router import RouterShape

SHAPE = RouterShape(128, 8)


def route_for(backend, shape: RouterShape = SHAPE, **switches):
    """`backend`'s route function for a layer of `shape` under these settings."""
    with settings.overridden(**{"force_torch_router": False, **switches}):
        return backend.build(torch.float32, settings.current()).router(shape)


def fused_kernel():
    if not cuda.triton_available():
        return None
    from r3srv.kernels.router_triton import route_triton

    return route_triton


def test_the_fused_kernel_routes_cuda_layers_only():
    assert route_for(cuda) is (fused_kernel() or route_reference)
    assert route_for(cpu) is not fused_kernel()


def test_layers_beyond_the_kernels_limits_take_the_reference():
    fused = fused_kernel() or route_reference
    assert route_for(cuda, RouterShape(128, 17)) is route_reference
    assert route_for(cuda, RouterShape(128, 10)) is fused  # Qwen3-Next's top-10 is fused
    assert route_for(cuda, RouterShape(1025, 8)) is route_reference
    assert route_for(cuda, RouterShape(128, 8, num_groups=64)) is route_reference
    assert route_for(cuda, RouterShape(256, 8, num_groups=8, correction_bias=True)) is fused  # DeepSeek-V3's


def test_cpu_group_limited_routing_is_the_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 32, generator=gen)
    bias = torch.randn(32, generator=gen)
    route = route_for(cpu, RouterShape(32, 6, num_groups=4, correction_bias=True))
    assert route is route_reference
    kwargs = dict(scoring="sigmoid", correction_bias=bias, num_groups=4, topk_groups=2, scaling=2.5)
    weights, ids = route(logits, 6, **kwargs)
    want_w, want_ids = route_reference(logits, 6, **kwargs)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_the_limits_match_the_kernel():
    router_triton = pytest.importorskip("r3srv.kernels.router_triton")
    assert (router_ops.FUSED_MAX_TOP_K, router_ops.FUSED_MAX_EXPERTS, router_ops.FUSED_MAX_GROUPS) == (
        router_triton.MAX_TOP_K, router_triton.MAX_EXPERTS, router_triton.MAX_GROUPS)


@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_env_var_forces_the_reference(value, forced):
    force = settings.Settings.from_environ({"R3SRV_FORCE_TORCH_ROUTER": value}).force_torch_router
    assert force == forced
    assert (route_for(cuda, force_torch_router=force) is route_reference) == (forced or fused_kernel() is None)
    assert (route_for(cpu, force_torch_router=force) is route_reference) == forced


def test_cpu_routing_without_the_rust_router_is_the_reference():
    route = route_for(cpu, RouterShape(64, 8), rust_router=False)  # on: tests/test_router_cpu.py
    assert route is route_reference
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 64, generator=gen)
    capture = torch.full((11, 2, 8), 7, dtype=torch.uint8)
    weights, ids = route(logits, 8, scoring="sigmoid", renormalize=False, capture=capture[:, 0])
    want_w, want_ids = route_reference(logits, 8, scoring="sigmoid", renormalize=False)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert torch.equal(capture[:, 0].int(), want_ids)


def test_the_fused_kernel_refuses_cpu_tensors_without_the_interpreter():
    # This process did not start with TRITON_INTERPRET=1 (the driver in
    # test_router_triton.py is what runs the kernel on the CPU).
    pytest.importorskip("triton")
    from r3srv.kernels import router_triton

    if router_triton.interpreter_enabled():
        pytest.skip("this process runs triton in its interpreter: CPU tensors are accepted")
    with pytest.raises(ValueError, match="CUDA tensors"):
        router_triton.route_triton(torch.zeros(2, 8), 2)
