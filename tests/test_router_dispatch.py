"""select_experts' backend choice (in process, no GPU and no interpreter needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from r3srv.kernels import router
from r3srv.kernels.router_reference import route_reference

CUDA_LIKE = SimpleNamespace(is_cuda=True, shape=(4, 128))  # uses_triton reads only these


@pytest.fixture(autouse=True)
def default_backend(r3srv_settings):
    r3srv_settings(force_torch_router=False)


def test_auto_uses_the_kernel_for_cuda_tensors_only():
    assert router.uses_triton(CUDA_LIKE, 8) == router.triton_available()
    assert router.uses_triton(CUDA_LIKE, 8, backend="auto") == router.triton_available()
    assert not router.uses_triton(torch.zeros(2, 8), 2)


def test_auto_falls_back_to_torch_beyond_the_kernels_limits():
    assert not router.uses_triton(CUDA_LIKE, 17)
    assert router.uses_triton(CUDA_LIKE, 10) == router.triton_available()  # Qwen3-Next's top-10 is fused
    assert not router.uses_triton(SimpleNamespace(is_cuda=True, shape=(4, 1025)), 8)
    assert not router.uses_triton(CUDA_LIKE, 8, num_groups=64)
    assert router.uses_triton(CUDA_LIKE, 8, num_groups=8) == router.triton_available()  # DeepSeek-V3's groups are fused


def test_cpu_group_limited_routing_is_the_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 32, generator=gen)
    bias = torch.randn(32, generator=gen)
    kwargs = dict(scoring="sigmoid", correction_bias=bias, num_groups=4, topk_groups=2, scaling=2.5)
    weights, ids = router.select_experts(logits, 6, **kwargs)
    want_w, want_ids = route_reference(logits, 6, **kwargs)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_dispatcher_limits_match_the_kernel():
    router_triton = pytest.importorskip("r3srv.kernels.router_triton")
    assert (router._FUSED_MAX_TOP_K, router._FUSED_MAX_EXPERTS, router._FUSED_MAX_GROUPS) == (
        router_triton.MAX_TOP_K, router_triton.MAX_EXPERTS, router_triton.MAX_GROUPS)


@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("0", False), ("", False)])
def test_env_var_forces_torch_in_auto_mode(r3srv_settings, value, forced):
    from r3srv.settings import Settings

    r3srv_settings(force_torch_router=Settings.from_environ({"R3SRV_FORCE_TORCH_ROUTER": value}).force_torch_router)
    assert router.uses_triton(CUDA_LIKE, 8) == (router.triton_available() and not forced)
    assert router.uses_triton(CUDA_LIKE, 8, backend="auto") == router.triton_available()  # an explicit choice wins


def test_explicit_backends():
    assert not router.uses_triton(CUDA_LIKE, 8, backend="torch")
    if router.triton_available():
        assert router.uses_triton(torch.zeros(2, 8), 2, backend="triton")
    with pytest.raises(ValueError, match="unknown router backend"):
        router.uses_triton(CUDA_LIKE, 8, backend="cuda")


def test_cpu_routing_without_the_rust_router_is_the_reference(r3srv_settings):
    r3srv_settings(rust_router=False)  # on: tests/test_router_cpu.py
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 64, generator=gen)
    capture = torch.full((11, 2, 8), 7, dtype=torch.uint8)
    weights, ids = router.select_experts(logits, 8, scoring="sigmoid", renormalize=False, capture=capture[:, 0])
    want_w, want_ids = route_reference(logits, 8, scoring="sigmoid", renormalize=False)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert torch.equal(capture[:, 0].int(), want_ids)


def test_forced_kernel_refuses_cpu_tensors_without_the_interpreter():
    # This process did not start with TRITON_INTERPRET=1 (the driver in
    # test_router_triton.py is what runs the kernel on the CPU).
    pytest.importorskip("triton")
    from r3srv.kernels import router_triton

    if router_triton.interpreter_enabled():
        pytest.skip("this process runs triton in its interpreter: CPU tensors are accepted")
    with pytest.raises(ValueError, match="CUDA tensors"):
        router.select_experts(torch.zeros(2, 8), 2, backend="triton")
