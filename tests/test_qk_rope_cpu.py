"""The Rust q/k norms + RoPE kernel (r3srv.kernels.qk_rope_cpu) against the torch ops the
attention layer runs without it, on generated shapes; its fallbacks; the CPU backend taking it
or not; and the built-in model's tokens and routed experts with it on and off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import assert_same_outputs_either_way, counting, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM
from r3srv import settings as settings_module
from r3srv.kernels import qk_rope_cpu
from r3srv.kernels.qk_rope_cpu import BUILT, qk_norm_rope
from r3srv.ops import ops_for
from r3srv.ops.norm import rms_norm
from r3srv.ops.rotary import apply_rope, rope_cos_sin, rope_inv_freq


def torch_heads(qkv, heads, kv_heads, dim, norms, eps, cos, sin):
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim), v.reshape(t, kv_heads, dim)
    if norms is not None:  # the reference norm (torch's)
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


def operands(seed, tokens, heads, kv_heads, dim, rotary, normed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    norms = (torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5) if normed else None
    norms = None if norms is None else (norms[0].to(dtype), norms[1].to(dtype))
    cos = sin = None
    if rotary:
        positions = torch.randint(0, 5000, (tokens,), generator=g)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(rotary, 1e6), dtype)
    return qkv, heads, kv_heads, dim, norms, 1e-6, cos, sin


def test_this_build_has_the_kernel():
    assert BUILT, "r3srv._core predates the q/k RoPE kernel: rebuild the extension"


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 80), heads=st.integers(1, 8), kv_heads=st.integers(1, 4),
       dim=st.sampled_from([2, 8, 30, 64, 128]), rotary_part=st.sampled_from([0, 0.5, 1.0]), normed=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_equals_the_torch_ops(tokens, heads, kv_heads, dim, rotary_part, normed, threads, seed):
    rotary = int(dim * rotary_part) // 2 * 2
    args = operands(seed, tokens, heads, kv_heads, dim, rotary, normed)
    got = qk_norm_rope(*args, threads=threads)  # more than 32 tokens: split over the threads
    want = torch_heads(*args)
    assert got is not None
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
    exact = 0 if not normed else 1e-5  # the rotation is torch's op for op; the norms round differently
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=exact, atol=exact)
    assert torch.equal(got[2], want[2])


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 80), heads=st.integers(1, 8), kv_heads=st.integers(1, 4),
       dim=st.sampled_from([2, 8, 30, 64, 128]), rotary_part=st.sampled_from([0, 0.5, 1.0]), normed=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_bfloat16_equals_the_torch_ops(tokens, heads, kv_heads, dim, rotary_part, normed, threads, seed):
    """Every op rounded to bfloat16 as torch's bfloat16 ops round it: the rotation bit for bit; a
    norm's mean of squares is summed in another order, which can move its rounding by one step."""
    rotary = int(dim * rotary_part) // 2 * 2
    args = operands(seed, tokens, heads, kv_heads, dim, rotary, normed, torch.bfloat16)
    got = qk_norm_rope(*args, threads=threads)  # more than 32 tokens: split over the threads
    want = torch_heads(*args)
    assert got is not None and all(a.dtype == torch.bfloat16 for a in got)
    for a, b in zip(got[:2], want[:2]):
        assert a.shape == b.shape and a.is_contiguous()
        if normed:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6)
        else:
            assert torch.equal(a, b)
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("case", ["mixed dtypes", "strided qkv", "odd rotary", "setting off", "norm shape", "wide qkv"])
def test_falls_back(case):
    qkv, heads, kv_heads, dim, norms, eps, cos, sin = operands(1, 3, 2, 1, 8, 8, True)
    if case == "mixed dtypes":
        qkv = qkv.bfloat16()
    elif case == "strided qkv":
        qkv = torch.cat([qkv, qkv], dim=1)[:, ::2]
    elif case == "odd rotary":
        cos, sin = cos[:, :3].contiguous(), sin[:, :3].contiguous()
    elif case == "norm shape":
        norms = (norms[0][:4], norms[1])
    elif case == "wide qkv":
        qkv = torch.randn(3, 41)
    if case == "setting off":  # the CPU backend does not take it at all
        with settings_module.overridden(rust_rope=False):
            assert ops_for("cpu", torch.float32).attention_heads is None
        with settings_module.overridden(cpu_threads=2):
            taken = ops_for("cpu", torch.float32).attention_heads
        assert taken.func is qk_norm_rope and taken.keywords == {"threads": 2}
    else:
        assert qk_norm_rope(qkv, heads, kv_heads, dim, norms, eps, cos, sin) is None


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)


def test_the_builtin_model_generates_the_same_tokens_and_rows_either_way(monkeypatch, llm):
    runs = []

    monkeypatch.setattr(qk_rope_cpu, "qk_norm_rope", counting(qk_norm_rope, runs))
    prompts = [prompt_ids(5, 1), prompt_ids(17, 2), prompt_ids(40, 3)]
    assert_same_outputs_either_way(llm, prompts, runs, "rust_rope")
