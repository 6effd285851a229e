"""Experts kept packed (kernels/expert_pairs_cpu.py's packed_experts): float32 ones in row tiles,
which the pass reads with the bits of the pair panels' wide chunks (each element one fused chain
over k), bfloat16 ones in the dot products' panels, read with the bits of the dot products' wide
chunks, on generated experts against the torch paths and a float64 pass; the copy follows its
parameter (made again after an in-place update or a move of its data, dropped with it) and is
never made of anything else."""

from __future__ import annotations

import gc
import platform
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv.kernels import expert_pairs_cpu, packed_weights
from r3srv.kernels.expert_pairs_cpu import ACTIVATIONS, BUILT, expert_pairs, packed_experts, packs
from r3srv.ops.experts import Activation, TorchExperts

pytestmark = pytest.mark.skipif(not (BUILT and packs()), reason="this CPU lacks AVX-512F (the row tiles the packed "
                                "experts run in) or the build lacks the expert kernel")
DTYPES = [torch.float32,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              not packs(torch.bfloat16), reason="this CPU lacks AVX-512 BF16, or its wide bfloat16 chunks run in AMX "
              "tiles (the packed bfloat16 experts run in the dot products)"))]


def experts_of(seed: int, experts: int, hidden: int, inter: int, rows_per_unit: int = 2,
               dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, rows_per_unit * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    return tuple(torch.nn.Parameter(w.to(dtype), requires_grad=False) for w in (w13, w2))


def routed(seed: int, tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k)
    return x, weights, ids.to(torch.int32)


def float64_pass(x, w13, w2, weights, ids, act) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass in float64 with the activation rounded to bfloat16 (as bfloat16 experts compute
    it), and each output's sum of its second products' sizes (one bfloat16 step of an activation
    value moves an output by 2^-8 of that at most)."""
    e = ids.long()
    h = torch.einsum("th,tkrh->tkr", x.double(), w13[e].double())
    a = act(h.float()).bfloat16().double()
    w2s = w2[e].double()
    w = weights.double().unsqueeze(-1)
    out = (w * torch.einsum("tki,tkhi->tkh", a, w2s)).sum(1)
    sizes = (w.abs() * torch.einsum("tki,tkhi->tkh", a.abs(), w2s.abs())).sum(1)
    return out, sizes


def activation(name: str) -> Activation:
    return Activation(name, alpha=1.702, limit=7.0) if name == "clamped_swiglu" else Activation(name)


def test_this_cpu_packs_float32_experts():
    flags = open("/proc/cpuinfo").read().split() if platform.system() == "Linux" else []
    assert packs() == ("avx512f" in flags and "avx2" in flags)


def test_bfloat16_experts_are_packed_where_their_wide_chunks_run_in_dot_products():
    """Packed bfloat16 experts are read where the AVX-512 BF16 dot products are the wide chunks'
    products: not where AMX tiles are (allowed and run), which have their own order."""
    flags = set(open("/proc/cpuinfo").read().split()) if platform.system() == "Linux" else set()
    try:
        for amx in (True, False):
            expert_pairs_cpu.allow_amx(amx)
            assert packs(torch.bfloat16) == (expert_pairs_cpu.bf16_products() == "avx512_bf16"), amx
        assert packs(torch.bfloat16) == ({"avx512f", "avx512_bf16"} <= flags)  # AMX tiles not allowed
    finally:
        expert_pairs_cpu.allow_amx(True)


@pytest.mark.parametrize("dtype", DTYPES)
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
def test_the_packed_pass_gives_the_wide_chunks_bits(dtype, tokens, experts, top_k, hidden, inter, act, seed):
    """Packed, every chunk (narrow or wide, any threads) is bit for bit the wide chunk of the
    experts read in place (float32: the pair panels' chains; bfloat16: the dot products'), and
    within float32 rounding of torch's pass (bfloat16: of the float64 pass with the activation
    rounded, as bfloat16 experts round it)."""
    top_k = min(top_k, experts)
    act = activation(act)
    w13, w2 = experts_of(seed, experts, hidden, inter, 1 if act.name == "relu_squared" else 2, dtype)
    x, weights, ids = routed(seed, tokens, experts, top_k, hidden, dtype)
    args = (x, w13, w2, weights, ids, None, None, None, act)
    wide = expert_pairs(*args, wide_min_pairs=1)  # every expert's pairs wide, the weights read in place
    for threads in (1, 2):
        for wide_min in (None, 1, 10**9):
            got = expert_pairs(*args, threads=threads, wide_min_pairs=wide_min, pack=True)
            assert torch.equal(got, wide), (threads, wide_min)
    if dtype == torch.bfloat16:
        want, sizes = float64_pass(x, w13.data, w2.data, weights, ids, act)
        assert ((wide.double() - want).abs() <= 2**-8 * (want.abs() + sizes) + 1e-5).all()
        return
    want = TorchExperts(act, pairs_mv=True)(x, w13.data, w2.data, weights, ids)
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_copy_follows_its_parameter(dtype):
    act = Activation("silu_and_mul")
    w13, w2 = experts_of(0, 8, 64, 32, dtype=dtype)
    x, weights, ids = routed(0, 20, 8, 2, 64, dtype)
    run = lambda: expert_pairs(x, w13, w2, weights, ids, None, None, None, act, pack=True)  # noqa: E731
    reference = lambda: expert_pairs(x, w13, w2, weights, ids, None, None, None, act, wide_min_pairs=1)  # noqa: E731
    first = packed_experts(w13, w2)
    assert first is not None and packed_experts(w13, w2)[0] is first[0]  # kept, not made again
    before = run()
    assert torch.equal(before, reference())

    with torch.no_grad():  # an in-place update (the loader's copy into a view of it, a trainer's push)
        w13[:, :4].copy_(torch.ones(8, 4, 64, dtype=dtype))
    assert packed_experts(w13, w2)[0] is first[0]  # packed again into the copy it has
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
    assert not keys & {key for key, kept in packed_weights._PACKED.items() if kept[0]() is not None}


@pytest.mark.parametrize("case", ["float16", "two dtypes", "not a parameter", "two dimensions"])
def test_nothing_else_is_packed(case):
    w13, w2 = experts_of(1, 4, 16, 8)
    if case == "float16":
        w13, w2 = experts_of(1, 4, 16, 8, dtype=torch.float16)
    elif case == "two dtypes":
        w2 = torch.nn.Parameter(w2.data.to(torch.bfloat16), requires_grad=False)
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
    monkeypatch.setattr(packed_weights, "available_bytes", lambda: 2 * copy_bytes - 1)
    assert packed_experts(w13, w2) is None
    got = expert_pairs(x, w13, w2, weights, ids, None, None, None, act, pack=True)
    assert torch.equal(got, expert_pairs(x, w13, w2, weights, ids, None, None, None, act))
    monkeypatch.setattr(packed_weights, "available_bytes", lambda: 2 * copy_bytes)
    with torch.no_grad():
        w13.mul_(1.0)  # the parameter changed: the answer is asked again
    assert packed_experts(w13, w2) is not None
