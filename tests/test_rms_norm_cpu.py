"""The Rust RMSNorm (kernels/rms_norm_cpu.py, rust/src/rms_norm.rs) against torch's on generated
float32 and bfloat16 inputs, where it applies and where it must step aside, the CPU backend's norm
with it on and off, and the built-in model's tokens and routed-experts rows with it on and off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from r3srv import LLM, SamplingParams, settings
from r3srv.kernels import rms_norm_cpu as kernel
from r3srv.ops import ops_for
from r3srv.ops.norm import rms_norm


def test_a_fresh_build_has_the_kernel():
    assert kernel.BUILT, "r3srv._core lacks rms_norm_f32: rebuild the extension (make install)"


@hsettings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 5), min_size=0, max_size=2), dim=st.integers(1, 300),
       seed=st.integers(0, 2**31 - 1), eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_rows_equal_torch_rms_norm(rows, dim, seed, eps):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, dim, generator=g) * 3
    w = torch.rand(dim, generator=g) + 0.5
    got = kernel.rms_norm_cpu(x, w, eps)
    assert got is not None and got.shape == x.shape
    torch.testing.assert_close(got, torch.rms_norm(x, (dim,), w, eps), rtol=2e-6, atol=2e-6)


@hsettings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 5), min_size=0, max_size=2), dim=st.integers(1, 300),
       seed=st.integers(0, 2**31 - 1), eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_bfloat16_rows_equal_the_hf_reference(rows, dim, seed, eps):
    """ops/norm.rms_norm's torch steps for bfloat16 (normalized in float32, rounded, times the
    weight, rounded): the same within two bfloat16 steps (the mean of squares is summed in
    another order, which can move the first rounding by one, and the second with it)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, dim, generator=g) * 3).bfloat16()
    w = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    got = kernel.rms_norm_cpu(x, w, eps)
    assert got is not None and got.shape == x.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), rms_norm(x, w, eps).float(), rtol=2**-6, atol=0)
    with settings.overridden(rust_rms_norm=True):  # the CPU backend's bfloat16 norm takes the kernel
        assert torch.equal(ops_for("cpu", torch.bfloat16).norm("default")(x, w, eps), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_give_the_same_bits(dtype, monkeypatch):
    """A prefill's rows split over the kernel's threads (items of 64 rows): the same bits on 1, 2
    and 3 threads, and the CPU backend's norm passes its thread count on."""
    g = torch.Generator().manual_seed(5)
    x, w = (torch.randn(300, 256, generator=g) * 3).to(dtype), (torch.rand(256, generator=g) + 0.5).to(dtype)
    one = kernel.rms_norm_cpu(x, w, 1e-6)
    for threads in (2, 3):
        assert torch.equal(kernel.rms_norm_cpu(x, w, 1e-6, threads=threads), one)
    calls = []
    real = kernel.rms_norm_cpu
    monkeypatch.setattr(kernel, "rms_norm_cpu", lambda *a, **k: calls.append(k.get("threads")) or real(*a, **k))
    with settings.overridden(rust_rms_norm=True, cpu_threads=3):
        assert torch.equal(ops_for("cpu", dtype).norm("default")(x, w, 1e-6), one)
    assert calls == [3]


def test_it_steps_aside_where_it_does_not_apply():
    x16 = torch.randn(4, 8).bfloat16()
    assert kernel.rms_norm_cpu(x16, torch.ones(8), 1e-6) is None  # mixed dtypes
    assert kernel.rms_norm_cpu(x16.half(), torch.ones(8).half(), 1e-6) is None  # float16
    x, w = torch.randn(4, 8), torch.ones(8)
    assert kernel.rms_norm_cpu(x.t().contiguous().t(), w, 1e-6) is None  # not contiguous
    assert kernel.rms_norm_cpu(x, torch.ones(2, 4), 1e-6) is None  # weight not [dim]
    assert kernel.rms_norm_cpu(x.requires_grad_(), w, 1e-6) is None  # autograd stays with torch
    with settings.overridden(rust_rms_norm=False):  # the CPU backend's norm is the reference's
        assert ops_for("cpu", torch.float32).norm("default") is rms_norm
    # the backend's norm gives torch's result either way
    y = torch.randn(3, 16)
    for norm in (rms_norm, ops_for("cpu", torch.float32).norm("default")):
        torch.testing.assert_close(norm(y, torch.ones(16), 1e-6), torch.rms_norm(y, (16,), torch.ones(16), 1e-6))
        torch.testing.assert_close(norm(y.t().contiguous().t(), torch.ones(16), 1e-6),  # the kernel steps aside
                                   torch.rms_norm(y, (16,), torch.ones(16), 1e-6))


def _generate(rust: bool) -> list[tuple[list[int], object]]:
    with settings.overridden(rust_rms_norm=rust):
        llm = LLM(max_model_len=256, enable_return_routed_experts=True)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([[(7 * i + k) % 250 + 1 for i in range(20 + k)] for k in range(3)], params)
        return [(o.outputs[0].token_ids, o.outputs[0].routed_experts) for o in outs]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_builtin_model_gives_the_same_tokens_and_rows_either_way():
    on, off = _generate(True), _generate(False)
    for (tokens_on, rows_on), (tokens_off, rows_off) in zip(on, off):
        assert tokens_on == tokens_off
        assert rows_on is not None and (rows_on == rows_off).all()
