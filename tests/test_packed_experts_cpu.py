"""Float32 experts packed in row tiles (kernels/expert_pairs_cpu.py's packed_experts): the pass
reads them with the bits of the pair panels' wide chunks (each element one fused chain over k),
on generated experts against the torch paths; the copy follows its parameter (made again after
an in-place update or a move of its data, dropped with it) and is never made of anything else."""

from __future__ import annotations

import gc
import platform
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv.kernels import expert_pairs_cpu
from r3srv.kernels.expert_pairs_cpu import ACTIVATIONS, BUILT, expert_pairs, packed_experts, packs
from r3srv.ops.experts import Activation, TorchExperts

pytestmark = pytest.mark.skipif(not (BUILT and packs()), reason="this CPU lacks AVX-512F (the row tiles the packed "
                                "experts run in) or the build lacks the expert kernel")


def experts_of(seed: int, experts: int, hidden: int, inter: int, rows_per_unit: int = 2):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.nn.Parameter(torch.randn(experts, rows_per_unit * inter, hidden, generator=gen) * 0.1,
                             requires_grad=False)
    w2 = torch.nn.Parameter(torch.randn(experts, hidden, inter, generator=gen) * 0.1, requires_grad=False)
    return w13, w2


def routed(seed: int, tokens: int, experts: int, top_k: int, hidden: int):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k)
    return x, weights, ids.to(torch.int32)


def activation(name: str) -> Activation:
    return Activation(name, alpha=1.702, limit=7.0) if name == "clamped_swiglu" else Activation(name)


def test_this_cpu_packs_float32_experts():
    flags = open("/proc/cpuinfo").read().split() if platform.system() == "Linux" else []
    assert packs() == ("avx512f" in flags and "avx2" in flags)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.one_of(st.integers(1, 8), st.integers(9, 200)),
    experts=st.sampled_from([4, 8, 64]),
    top_k=st.integers(1, 4),
    hidden=st.sampled_from([8, 40, 70, 128]),
    inter=st.sampled_from([4, 24, 96]),
    act=st.sampled_from(sorted(ACTIVATIONS)),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_packed_pass_gives_the_wide_chunks_bits(tokens, experts, top_k, hidden, inter, act, seed):
    """Packed, every chunk (narrow or wide, any threads) is bit for bit the pair panels' wide chunk
    of the experts read in place, and within float32 rounding of torch's pass."""
    top_k = min(top_k, experts)
    act = activation(act)
    w13, w2 = experts_of(seed, experts, hidden, inter, 1 if act.name == "relu_squared" else 2)
    x, weights, ids = routed(seed, tokens, experts, top_k, hidden)
    args = (x, w13, w2, weights, ids, None, None, None, act)
    panels = expert_pairs(*args, wide_min_pairs=1)  # every expert's pairs wide: the pair panels' chains
    for threads in (1, 2):
        for wide_min in (None, 1, 10**9):
            got = expert_pairs(*args, threads=threads, wide_min_pairs=wide_min, pack=True)
            assert torch.equal(got, panels), (threads, wide_min)
    want = TorchExperts(act, pairs_mv=True)(x, w13.data, w2.data, weights, ids)
    torch.testing.assert_close(panels, want, rtol=1e-5, atol=1e-5)


def test_the_copy_follows_its_parameter():
    act = Activation("silu_and_mul")
    w13, w2 = experts_of(0, 8, 64, 32)
    x, weights, ids = routed(0, 20, 8, 2, 64)
    run = lambda: expert_pairs(x, w13, w2, weights, ids, None, None, None, act, pack=True)  # noqa: E731
    reference = lambda: expert_pairs(x, w13, w2, weights, ids, None, None, None, act, wide_min_pairs=1)  # noqa: E731
    first = packed_experts(w13, w2)
    assert first is not None and packed_experts(w13, w2)[0] is first[0]  # kept, not made again
    before = run()
    assert torch.equal(before, reference())

    with torch.no_grad():  # an in-place update (the loader's copy into a view of it, a trainer's push)
        w13[:, :4].copy_(torch.ones(8, 4, 64))
    assert packed_experts(w13, w2)[0] is not first[0]
    after = run()
    assert not torch.equal(after, before) and torch.equal(after, reference())

    w2.data = w2.data * 2  # the data moved elsewhere (weights released and resumed, pinned)
    moved = run()
    assert torch.equal(moved, reference()) and torch.allclose(moved, after * 2, rtol=1e-5, atol=1e-6)

    copies = [weakref.ref(t) for t in packed_experts(w13, w2)]
    keys = {id(w13), id(w2)}
    del w13, w2, run, reference, first
    gc.collect()
    assert all(copy() is None for copy in copies)  # dropped with the parameters
    assert not keys & {key for key, kept in expert_pairs_cpu._PACKED.items() if kept[0]() is not None}


@pytest.mark.parametrize("case", ["bfloat16", "not a parameter", "two dimensions"])
def test_nothing_else_is_packed(case):
    w13, w2 = experts_of(1, 4, 16, 8)
    if case == "bfloat16":
        w13, w2 = (torch.nn.Parameter(w.to(torch.bfloat16), requires_grad=False) for w in (w13, w2))
    elif case == "not a parameter":
        w13, w2 = w13.data, w2.data
    else:
        w13 = torch.nn.Parameter(w13.data.reshape(4 * 16, 16), requires_grad=False)
    assert packed_experts(w13, w2) is None


def test_no_copy_where_the_host_lacks_the_memory(monkeypatch):
    """A copy that would take more than half the host's available memory is not made: the pass
    reads the rows in place, with the narrow chunks' own bits."""
    act = Activation("silu_and_mul")
    w13, w2 = experts_of(2, 8, 64, 32)
    x, weights, ids = routed(2, 6, 8, 2, 64)
    copy_bytes = 4 * w13.numel()  # 64 outputs a block: as large as the weights here
    monkeypatch.setattr(expert_pairs_cpu, "available_bytes", lambda: 2 * copy_bytes - 1)
    assert packed_experts(w13, w2) is None
    got = expert_pairs(x, w13, w2, weights, ids, None, None, None, act, pack=True)
    assert torch.equal(got, expert_pairs(x, w13, w2, weights, ids, None, None, None, act))
    monkeypatch.setattr(expert_pairs_cpu, "available_bytes", lambda: 2 * copy_bytes)
    with torch.no_grad():
        w13.mul_(1.0)  # the parameter changed: the answer is asked again
    assert packed_experts(w13, w2) is not None
