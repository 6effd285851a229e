"""The Rust expert pass (r3srv.kernels.expert_pairs_cpu) against the torch paths on generated
inputs (from one token to many pairs per expert), its batch invariance, its fallbacks, the CPU
backend's expert pass with it on and off, and the built-in model's tokens and routed experts
with it on and off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import assert_same_outputs_either_way, counting, one_torch_thread, prompt_ids  # noqa: F401 (autouse fixture)
from r3srv import LLM, _core
from r3srv import settings as r3srv_settings_module
from r3srv.kernels import expert_pairs_cpu
from r3srv.kernels.expert_pairs_cpu import BUILT, expert_pairs, wide_min_pairs
from r3srv.ops import ops_for
from r3srv.ops.experts import Activation, KernelExperts, TorchExperts, silu_and_mul

ACTIVATIONS = {name: Activation(name, *constants) for name, constants in
               {"silu_and_mul": (), "relu_squared": (), "clamped_swiglu": (1.702, 0.4)}.items()}


def random_experts(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, act: str,
                   b13: bool, b2: bool):
    """expert_pairs' arguments for every token's top_k slots: (x, w13, w2, weights, ids,
    tokens=None, b13, b2, act)."""
    gen = torch.Generator().manual_seed(seed)
    rows13 = inter * (1 if act == "relu_squared" else 2)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, rows13, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k)
    bias13 = torch.randn(experts, rows13, generator=gen) * 0.3 if b13 else None
    bias2 = torch.randn(experts, hidden, generator=gen) * 0.3 if b2 else None
    return x, w13, w2, weights, ids.to(torch.int32), None, bias13, bias2, ACTIVATIONS[act]


def as_list(args, seed: int | None = None):
    """The same pairs as an explicit (tokens, ids, weights) list; with a seed, shuffled and
    a third of them dropped (an expert-parallel rank's share)."""
    x, w13, w2, weights, ids, tokens, b13, b2, act = args
    if tokens is None:
        tokens = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])
    ids, weights = ids.reshape(-1), weights.reshape(-1)
    if seed is not None:
        keep = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))
        keep = keep[: max(1, ids.numel() - ids.numel() // 3)]
        tokens, ids, weights = tokens[keep], ids[keep], weights[keep]
    return x, w13, w2, weights, ids, tokens, b13, b2, act


def rounded_activation_pass(args, round_activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_pairs' arguments' pass in float64 with the activation rounded to bfloat16 (as the
    kernel computes bfloat16 experts), and each output's sum of its second products' sizes: one
    bfloat16 step of an activation value, where the kernel's float32 h and this one round apart,
    moves an output by 2^-8 of that at most."""
    x, w13, w2, weights, ids, tokens, b13, b2, activation = as_list(args)
    e = ids.long()
    h = torch.einsum("ph,prh->pr", x[tokens].double(), w13[e].double())
    if b13 is not None:
        h = h + b13[e].double()
    a = activation(h.float())  # ops/experts.py's activation
    if round_activation:
        a = a.bfloat16()
    w2s = w2[e].double()
    o = torch.einsum("pi,phi->ph", a.double(), w2s)
    if b2 is not None:
        o = o + b2[e].double()
    sizes = torch.einsum("pi,phi->ph", a.double().abs(), w2s.abs())
    w = weights.double().unsqueeze(-1)
    out = torch.zeros(x.shape, dtype=torch.float64).index_add_(0, tokens, w * o)
    return out, torch.zeros(x.shape, dtype=torch.float64).index_add_(0, tokens, w.abs() * sizes)


def torch_pass(args, path: str) -> torch.Tensor:
    """The CPU backend's torch pass (the kernel off) on these pairs, through its pairs path
    ("pairs": never-routed zero experts make the experts outnumber the pairs) or its
    sort-and-scatter path ("sorted": zero-weight pairs make the pairs outnumber the experts)."""
    x, w13, w2, weights, ids, tokens, b13, b2, act = as_list(args)
    if path == "pairs":
        extra = max(0, ids.numel() + 1 - w13.shape[0])
        w13, w2, b13, b2 = (None if w is None else torch.cat([w, w.new_zeros(extra, *w.shape[1:])]) for w in (w13, w2, b13, b2))
    else:
        extra = max(0, w13.shape[0] - ids.numel())
        tokens, ids, weights = (torch.cat([v, v.new_zeros(extra)]) for v in (tokens, ids, weights))
    return cpu_pass(act, cpu_expert_kernel=False)(x, w13, w2, weights, ids, tokens=tokens, b13=b13, b2=b2)


def cpu_pass(act: Activation, **switches):
    """The CPU backend's expert pass for `act` under these settings."""
    with r3srv_settings_module.overridden(**switches):
        return ops_for("cpu", torch.float32).experts(act)


def float_args(args, dtype: torch.dtype):
    """x, the experts and the biases in `dtype` (routing weights stay float32, as the router gives them)."""
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and i != 3 else a
                 for i, a in enumerate(args))


@settings(max_examples=40, deadline=None)
@given(
    # up to 150 tokens on 4 experts: several of the kernel's chunks of pairs per expert
    tokens=st.one_of(st.integers(1, 8), st.integers(9, 150)),
    experts=st.sampled_from([4, 8, 12, 64]),
    top_k=st.integers(1, 8),
    hidden=st.sampled_from([8, 13, 40]),
    inter=st.sampled_from([4, 7, 16]),
    act=st.sampled_from(sorted(ACTIVATIONS)),
    # b2 without b13 never occurs (a tensor-parallel split keeps b13 on every rank, b2 on one)
    biases=st.sampled_from([(False, False), (True, True), (True, False)]),
    listed=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_the_torch_paths(tokens, experts, top_k, hidden, inter, act, biases, listed, bfloat16, seed):
    args = random_experts(seed, tokens, experts, min(top_k, experts), hidden, inter, act, *biases)
    if listed:
        args = as_list(args, seed)
    if bfloat16:  # the same values in bfloat16: the pass with the activation rounded to bfloat16
        args = float_args(args, torch.bfloat16)
    got = expert_pairs(*args)
    assert got is not None and got.shape == (tokens, hidden) and got.dtype == args[0].dtype
    if bfloat16:
        want, sizes = rounded_activation_pass(args)
        assert ((got.double() - want).abs() <= 2**-8 * (want.abs() + sizes) + 1e-5).all()
        # the torch path rounds every intermediate to bfloat16: within a few bfloat16 steps of the terms' size
        assert ((got.double() - torch_pass(args, "pairs").double()).abs() <= 2**-5 * (want.abs() + sizes) + 1e-3).all()
        return
    torch.testing.assert_close(got, torch_pass(args, "pairs"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, torch_pass(args, "sorted"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tokens", [300, 40], ids=["wide", "narrow"])
def test_bfloat16_experts_round_the_activation(act, seed, tokens):
    """bfloat16 experts round the activation to bfloat16 before the second product, as
    transformers' bfloat16 experts do, in wide chunks (an expert's pairs from 64 on: a prefill's)
    and narrow ones, in AVX-512 BF16 dot products where the CPU has them: float64 products with
    that rounding, the sum rounded once, against the kernel; the float32 activation is a
    measurably different result."""
    args = float_args(random_experts(seed, tokens, 4, 2, 96, 48, act, True, True), torch.bfloat16)
    assert (args[4].numel() // 4 >= 64 * 2) == (tokens == 300), "every expert wide, or every one narrow"
    got = expert_pairs(*args)

    want, sizes = rounded_activation_pass(args)
    err = (got.double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 2**-8 * sizes + 1e-5).all(), "one rounding of the sum, one step of an activation"
    unrounded = rounded_activation_pass(args, round_activation=False)[0]
    assert err.sum() < 0.9 * (got.double() - unrounded).abs().sum(), "nearer the rounded activation's pass"


@pytest.mark.parametrize("amx", [True, False], ids=["amx-tiles", "no-amx-tiles"])
def test_bfloat16_wide_chunks_in_amx_tiles_or_dot_products(amx):
    """settings.amx_tiles, applied when a model's CPU ops are built: wide bfloat16 chunks run in
    AMX tiles where the CPU has them (its flags say amx_bf16), else in the AVX-512 BF16 dot
    products (or widened to float32 without them); either way within the bound of the rounded
    activation's float64 pass."""
    from r3srv.kernels import cpu_isa

    try:
        with r3srv_settings_module.overridden(amx_tiles=amx):
            ops_for("cpu", torch.bfloat16)
        flags = cpu_isa.cpu_flags()
        want = ("amx" if amx and "amx_bf16" in flags else
                "avx512_bf16" if {"avx512f", "avx512_bf16"} <= flags else "float32")
        assert expert_pairs_cpu.bf16_products() == want, flags
        for seed in range(3):
            args = float_args(random_experts(seed, 600, 8, 2, 128, 64, "silu_and_mul", False, False), torch.bfloat16)
            got = expert_pairs(*args)
            want_pass, sizes = rounded_activation_pass(args)
            err = (got.double() - want_pass).abs()
            assert (err <= 2**-8 * want_pass.abs() + 2**-8 * sizes + 1e-5).all(), (amx, seed)
    finally:
        expert_pairs_cpu.allow_amx(True)


@pytest.mark.parametrize("listed", [False, True])
@pytest.mark.parametrize("tokens", [2, 300])
def test_the_moe_pass_takes_it_at_every_batch_size(monkeypatch, listed, tokens):
    args = random_experts(1, tokens, 64, 8, 24, 16, "silu_and_mul", True, True)
    if listed:
        args = as_list(args, 1)
    x, w13, w2, weights, ids, tokens, b13, b2, act = args
    expert_pass = cpu_pass(act)
    assert isinstance(expert_pass, KernelExperts)
    assert isinstance(cpu_pass(act, cpu_expert_kernel=False), TorchExperts)  # the setting off: never the kernel
    for name in ("mv", "argsort"):  # the torch paths' first steps: must not run
        monkeypatch.setattr(torch, name, None)
    got = expert_pass(x, w13, w2, weights, ids, tokens=tokens, b13=b13, b2=b2)
    torch.testing.assert_close(got, expert_pairs(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, told", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 64)],
                         ids=["float32", "bfloat16", "float32 told 64"])
def test_a_tokens_result_does_not_depend_on_its_batch_in_narrow_chunks(dtype, told):
    """Every expert below the wide threshold (the kernel's for the dtype, wide_min_pairs: 16 or
    64 pairs, or the one it is told): half of it each on average."""
    limit = told or wide_min_pairs(dtype)
    assert limit in (16, 64)
    tokens = limit * 8 // 2 // 4  # 8 experts, top-4
    args = random_experts(4, tokens, 8, 4, 32, 16, "clamped_swiglu", True, True)
    x, w13, w2, weights, ids, _, b13, b2, act = args
    x, w13, w2, b13, b2 = (t.to(dtype) for t in (x, w13, w2, b13, b2))
    assert torch.bincount(ids.reshape(-1).long()).max() < limit
    batch = expert_pairs(x, w13, w2, weights, ids, None, b13, b2, act, wide_min_pairs=told)
    for t in (0, tokens // 2, tokens - 1):
        alone = expert_pairs(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], None, b13, b2, act,
                             wide_min_pairs=told)
        assert torch.equal(alone[0], batch[t])
    if told and wide_min_pairs(dtype) < told:  # the kernel's own threshold makes some experts wide
        assert not torch.equal(expert_pairs(x, w13, w2, weights, ids, None, b13, b2, act), batch)


@pytest.mark.parametrize("case", ["float16", "mixed dtypes", "strided w13", "other activation", "int64 ids, float64 weights"])
def test_falls_back_or_converts(case):
    args = random_experts(2, 3, 12, 2, 16, 8, "silu_and_mul", True, True)
    x, w13, w2, weights, ids, tokens, b13, b2, act = args
    if case == "float16":
        assert expert_pairs(*float_args(args, torch.float16)) is None
    elif case == "mixed dtypes":
        assert expert_pairs(x.bfloat16(), *args[1:]) is None
    elif case == "strided w13":
        strided = torch.cat([w13, w13], dim=2)[..., ::2]
        assert not strided.is_contiguous()
        assert expert_pairs(x, strided, *args[2:]) is None
    elif case == "other activation":
        assert expert_pairs(*args[:-1], lambda h: silu_and_mul(h)) is None
    else:
        got = expert_pairs(x, w13, w2, weights.double(), ids.long(), tokens, b13, b2, act)
        torch.testing.assert_close(got, torch_pass(args, "pairs"), rtol=1e-5, atol=1e-5)


def test_an_expert_id_or_token_out_of_range_is_a_value_error():
    args = random_experts(3, 2, 12, 2, 16, 8, "relu_squared", False, False)
    args[4][1, 0] = 12
    with pytest.raises(ValueError, match="expert id 12 is outside 0..12"):
        expert_pairs(*args)
    args[4][1, 0] = 0
    x, w13, w2, weights, ids, tokens, b13, b2, act = as_list(args)
    tokens[2] = 2
    with pytest.raises(ValueError, match="token 2 is outside 0..2"):
        expert_pairs(x, w13, w2, weights, ids, tokens, b13, b2, act)


def test_this_build_has_the_kernel_and_this_cpu_runs_its_vector_code():
    import platform

    assert BUILT, "r3srv._core predates the expert kernel: rebuild the extension"
    flags = open("/proc/cpuinfo").read().split() if platform.system() == "Linux" else []
    vector = "auto" if "avx512f" in flags else "avx2"  # auto: AVX-512 for large weight blocks, AVX2 below
    assert _core.expert_pairs_isa() == (vector if {"avx2", "fma"} <= set(flags) else "scalar")
    # float32 experts in pair panels (AVX2 and FMA, or wider) are wide from 16 pairs, others from 64
    assert wide_min_pairs(torch.float32) == (16 if {"avx2", "fma"} <= set(flags) else 64)
    # from 16 where AMX tiles run them (settings.amx_tiles, on unless a test turned it off)
    assert wide_min_pairs(torch.bfloat16) == (16 if expert_pairs_cpu.bf16_products() == "amx" else 64)
    if "amx_bf16" in flags:
        expert_pairs_cpu.allow_amx(False)
        try:
            assert wide_min_pairs(torch.bfloat16) == 64
        finally:
            expert_pairs_cpu.allow_amx(True)
    assert wide_min_pairs(torch.float16) is None


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)


def test_the_builtin_model_generates_the_same_tokens_and_rows_either_way(monkeypatch, llm):
    kernel_runs = []

    monkeypatch.setattr(expert_pairs_cpu, "expert_pairs", counting(expert_pairs, kernel_runs))
    prompts = [prompt_ids(5, 1), prompt_ids(17, 2), prompt_ids(40, 3)]
    for batch in (prompts, prompts[:1]):  # three sequences (prefills of 62 tokens), then one
        kernel_runs.clear()
        assert_same_outputs_either_way(llm, batch, kernel_runs, "cpu_expert_kernel")
