"""The expert pass as two grouped GEMMs equals the per-expert loop bitwise on the CPU, and the
dispatch picks each where it is faster (or the only one supported)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv import settings as settings_module
from r3srv.ops import experts as moe
from r3srv.ops import ops_for
from r3srv.ops.experts import SILU_AND_MUL, TorchExperts

CPU_PASS = TorchExperts(SILU_AND_MUL, pairs_mv=True, grouped="cpu")  # the CPU backend's torch pass


def random_routing(gen: torch.Generator, tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    # skewed router logits: some experts get many rows, some none
    logits = torch.randn(tokens, experts, generator=gen) + torch.linspace(0, 3, experts)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    experts=st.sampled_from([2, 8, 60]),
    top_k=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    gpt_oss=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_gemms_equal_the_loop_bitwise(tokens, experts, top_k, dtype, gpt_oss, seed):
    gen = torch.Generator().manual_seed(seed)
    args = random_routing(gen, tokens, experts, top_k, 16, 8, dtype)
    x, w13, w2, weights, ids = args
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // top_k)
    counts = torch.bincount(flat, minlength=experts)
    kwargs = {}
    if gpt_oss:  # biased experts with the clamped, interleaved SwiGLU
        b13, b2 = torch.randn(experts, 16, generator=gen).to(dtype), torch.randn(experts, 16, generator=gen).to(dtype)
        kwargs = dict(act=lambda h: moe.clamped_swiglu(h, 1.702, 0.3), biases=(b13, b2, flat[order]))
    grouped = moe.expert_mlps_grouped(rows, w13, w2, counts, **kwargs)
    looped = moe.expert_mlps_looped(rows, w13, w2, counts, **kwargs)
    assert torch.equal(grouped, looped)


def test_dispatch_on_the_cpu():
    rows, w2 = torch.zeros(64, 8), torch.zeros(64, 8, 4)  # 64 experts, hidden 8, intermediate 4
    assert CPU_PASS.uses_grouped_mm(rows, w2)  # a row per expert: grouped
    assert not CPU_PASS.uses_grouped_mm(rows[:8], w2)  # one-sequence decode: the loop
    assert not CPU_PASS.uses_grouped_mm(torch.zeros(17 * 64, 8), w2)  # a long prefill: the loop
    # rows that do not start on 16-byte boundaries (10 floats, 6 bfloat16s): grouped_mm refuses them
    assert not CPU_PASS.uses_grouped_mm(torch.zeros(64, 10), torch.zeros(64, 10, 4))
    assert not CPU_PASS.uses_grouped_mm(torch.zeros(64, 8, dtype=torch.bfloat16),
                                        torch.zeros(64, 8, 6, dtype=torch.bfloat16))
    with settings_module.overridden(grouped_mm=False, cpu_expert_kernel=False):
        cpu_pass = ops_for("cpu", torch.float32).experts(SILU_AND_MUL)
    assert cpu_pass == TorchExperts(SILU_AND_MUL, pairs_mv=True, grouped=None)
    assert not cpu_pass.uses_grouped_mm(rows, w2)


def test_unaligned_shapes_take_the_loop_and_still_work():
    x, w13, w2, weights, ids = random_routing(torch.Generator().manual_seed(1), 40, 4, 2, 10, 6, torch.float32)
    out = CPU_PASS(x, w13, w2, weights, ids)
    assert out.shape == x.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("grouped_mm", [False, True])
@pytest.mark.parametrize("tokens", [32, 3])  # 3 tokens x 2 slots < 8 experts: one pair at a time
def test_the_whole_expert_pass_is_the_same_on_either_path(grouped_mm, tokens):
    expert_pass = TorchExperts(SILU_AND_MUL, pairs_mv=True, grouped="cpu" if grouped_mm else None)
    x, w13, w2, weights, ids = random_routing(torch.Generator().manual_seed(3), tokens, 8, 2, 16, 8, torch.float32)
    want = torch.zeros_like(x)
    for t in range(tokens):  # the definition, token by token
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (x[t] @ w13[e].T).chunk(2)
            want[t] += weights[t, j] * ((torch.nn.functional.silu(gate) * up) @ w2[e].T)
    torch.testing.assert_close(expert_pass(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-6)
