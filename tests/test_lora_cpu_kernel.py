"""LoRA through the Rust core on the CPU (r3srv.lora.cpu_kernel, rust/src/pair_projection.rs):
the expert pass against the torch loop over (slot, expert) groups it replaces (LoraExperts._run), on
Hypothesis-drawn experts, activations, slots (with and without expert adapters, per-expert or
shared sides, their own ranks), tokens and pairs; a linear layer's terms against its per-slot
loop; and an engine serving adapters on the routed
experts takes it, with PEFT's tokens and logprobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_testing import assert_matches, peft_reference, prompt, write_adapter, write_checkpoint

from r3srv import LLM, SamplingParams
from r3srv.kernels import pair_projection_cpu
from r3srv.lora import cpu_kernel
from r3srv.lora.slots import LoraBatch, LoraContext, LoraExperts, LoraLinear
from r3srv.ops.experts import Activation

pytestmark = pytest.mark.skipif(not pair_projection_cpu.BUILT, reason="the Rust extension is not built")

ACTIVATIONS = [Activation("silu_and_mul"), Activation("relu_squared"), Activation("clamped_swiglu", 1.702, 7.0)]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The Rust entry point's calls since the test began."""
    calls = []
    entry = pair_projection_cpu.project_pairs_entry

    def counted(*args):
        calls.append(args)
        return entry(*args)

    monkeypatch.setattr(pair_projection_cpu, "project_pairs_entry", counted)
    return calls


def _pair(gen, num_experts, out_rows, in_cols, rank, shared_a, shared_b, dtype):
    a = torch.randn(1 if shared_a else num_experts, rank, in_cols, generator=gen) * 0.5
    b = torch.randn(1 if shared_b else num_experts, out_rows, rank, generator=gen) * 0.5
    return a.to(dtype), b.to(dtype)


@st.composite
def cases(draw):
    act = draw(st.sampled_from(ACTIVATIONS))
    num_experts, hidden, inter = draw(st.integers(1, 6)), draw(st.integers(1, 12)), draw(st.integers(1, 10))
    num_slots = draw(st.integers(1, 4))
    # per slot and projection: None (left as in the base) or (rank, A shared, B shared)
    pair = st.none() | st.tuples(st.integers(1, 6), st.booleans(), st.booleans())
    slots = [(draw(pair), draw(pair)) for _ in range(num_slots)]
    num_tokens = draw(st.integers(1, 7))
    token_slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_tokens, max_size=num_tokens))
    grid = draw(st.booleans())
    top_k = draw(st.integers(1, 3)) if grid else 0
    num_pairs = num_tokens * top_k if grid else draw(st.integers(1, 12))
    ids = draw(st.lists(st.integers(0, num_experts - 1), min_size=num_pairs, max_size=num_pairs))
    tokens = None if grid else draw(st.lists(st.integers(0, num_tokens - 1), min_size=num_pairs, max_size=num_pairs))
    biases = draw(st.sampled_from(["none", "both", "b2"]))
    seed = draw(st.integers(0, 2**16))
    return act, num_experts, hidden, inter, slots, token_slots, top_k, ids, tokens, biases, seed


def _build(case, dtype):
    act, num_experts, hidden, inter, slots, token_slots, top_k, ids, tokens, biases, seed = case
    gen = torch.Generator().manual_seed(seed)
    rows13 = inter * (2 if act.gated else 1)
    w13 = torch.randn(num_experts, rows13, hidden, generator=gen).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen).to(dtype)
    context = LoraContext(len(slots))
    holder = LoraExperts(context, w13.shape, w2.shape)
    for slot, (p13, p2) in enumerate(slots):
        for which, spec, (out_rows, in_cols) in (("w13", p13, (rows13, hidden)), ("w2", p2, (hidden, inter))):
            if spec is not None:
                holder.load(slot, which, *_pair(gen, num_experts, out_rows, in_cols, *spec, dtype))
    context.batch = LoraBatch.of_token_slots(torch.tensor(token_slots), torch.device("cpu"))
    x = torch.randn(len(token_slots), hidden, generator=gen).to(dtype)
    shape = (len(token_slots), top_k) if tokens is None else (len(ids),)
    id_tensor = torch.tensor(ids, dtype=torch.int32).view(shape)
    weights = torch.rand(shape, generator=gen)
    b13 = torch.randn(num_experts, rows13, generator=gen).to(dtype) if biases == "both" else None
    b2 = torch.randn(num_experts, hidden, generator=gen).to(dtype) if biases != "none" else None
    token_tensor = None if tokens is None else torch.tensor(tokens)
    return holder, act, (x, w13, w2, weights, id_tensor), dict(tokens=token_tensor, b13=b13, b2=b2)


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_rust_pass_equals_the_torch_grouped_loop(case):
    holder, act, args, kwargs = _build(case, torch.float32)
    if holder.context.batch is None:  # no token under an adapter: the base pass runs, not this one
        assert all(s < 0 for s in case[5])
        return
    calls = []
    entry = pair_projection_cpu.project_pairs_entry
    pair_projection_cpu.project_pairs_entry = lambda *a: (calls.append(a), entry(*a))[1]
    try:
        got = holder.expert_pass(act, F.linear)(*args, **kwargs)
    finally:
        pair_projection_cpu.project_pairs_entry = entry
    x, w13, w2, weights, ids = args
    want = holder._run(x, w13, w2, weights, ids, kwargs["tokens"], kwargs["b13"], kwargs["b2"], act, F.linear)
    assert len(calls) >= 2  # the base projections at least, through the kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_bfloat16_experts_within_bfloat16_rounding(case):
    """bfloat16 weights and adapters: the kernel runs float32 throughout (rounded once), the torch
    loop of the same weights widened to float32 is the oracle: they agree to bfloat16's precision."""
    holder, act, args, kwargs = _build(case, torch.bfloat16)
    if holder.context.batch is None:
        return
    x, w13, w2, weights, ids = args
    got = holder.expert_pass(act, F.linear)(*args, **kwargs)
    assert got is not None and got.dtype == torch.bfloat16
    if any(p is not None for pair in case[4] for p in pair):  # bfloat16 pairs are no float32 table: never misread
        assert None in holder.tables(torch.float32)
    want = holder._run(x.float(), w13.float(), w2.float(), weights, ids, kwargs["tokens"],
                       *(None if b is None else b.float() for b in (kwargs["b13"], kwargs["b2"])), act, _widened)
    scale = want.abs().max().clamp(min=1.0)
    assert (got.float() - want).abs().max() <= 0.05 * scale


def _widened(x, w):
    return F.linear(x.float(), w.float())


@settings(max_examples=100, deadline=None)
@given(num_slots=st.integers(1, 4), out_features=st.integers(1, 12), in_features=st.integers(1, 12),
       ranks=st.lists(st.none() | st.integers(1, 6), min_size=4, max_size=4),
       token_slots=st.lists(st.integers(-1, 3), min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_rust_linear_terms_equal_the_per_slot_loop(num_slots, out_features, in_features, ranks, token_slots, seed):
    """A linear layer's adapters (slots without one, tokens under none) through the kernel equal
    the torch pass of one low-rank product per slot in the step."""
    gen = torch.Generator().manual_seed(seed)
    context = LoraContext(num_slots)
    holder = LoraLinear(context, out_features, in_features)
    for slot, rank in enumerate(ranks[:num_slots]):
        if rank is not None:
            holder.load(slot, torch.randn(rank, in_features, generator=gen), torch.randn(out_features, rank, generator=gen))
    context.batch = LoraBatch.of_token_slots(torch.tensor([s % num_slots if s >= 0 else -1 for s in token_slots]),
                                             torch.device("cpu"))
    if context.batch is None:
        return
    x = torch.randn(len(token_slots), in_features, generator=gen)
    y = torch.randn(len(token_slots), out_features, generator=gen)
    calls = []  # what each call of the low-rank kernel said: whether a token had an adapter
    entry = pair_projection_cpu.add_low_rank_entry
    pair_projection_cpu.add_low_rank_entry = lambda *a: (calls.append(entry(*a)), calls[-1])[1]
    try:
        got = holder(x, y, F.linear)
    finally:
        pair_projection_cpu.add_low_rank_entry = entry
    want = holder.grouped(x, y, F.linear)
    adapted = any(holder.pairs[s] is not None for s, _ in context.batch.groups)
    assert calls == ([True] if adapted else [False] if any(p is not None for p in holder.pairs) else [])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_out_of_range_expert_ids_fall_back_to_torch(kernel_calls):
    """An id outside the experts would send the kernel outside w13: it declines."""
    case = (ACTIVATIONS[0], 2, 4, 3, [((2, False, False), None)], [0, 0], 1, [0, 1], None, "none", 0)
    holder, act, (x, w13, w2, weights, ids), _ = _build(case, torch.float32)
    bad = torch.tensor([[0], [2]], dtype=torch.int32)
    assert cpu_kernel.expert_pass(x, w13, w2, weights, bad, None, None, None, act, holder.tables(torch.float32),
                                     holder.context.batch.token_slots) is None
    assert not kernel_calls


def test_mismatched_tables_are_refused():
    """A pair whose shape does not fit the weight gets no table: the kernel never reads it."""
    context = LoraContext(1)
    holder = LoraExperts(context, (2, 6, 4), (2, 4, 3))
    holder.load(0, "w13", torch.zeros(2, 2, 5), torch.zeros(2, 6, 2))  # A over 5 inputs, not 4
    assert holder.tables(torch.float32)[0] is None


def test_project_pairs_checks_its_tensors():
    x, out = torch.zeros(2, 3), torch.zeros(2, 4)
    table = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="out"):
        pair_projection_cpu.project_pairs(x, out.double(), table, table, table, torch.float32)
    with pytest.raises(ValueError, match="one value per row"):
        pair_projection_cpu.project_pairs(x, out, table[:1], table, table, torch.float32)


@pytest.mark.slow  # transformers + PEFT oracle
def test_an_engine_with_expert_adapters_takes_the_rust_pass(tmp_path, kernel_calls):
    family = "qwen3_moe"
    ckpt = write_checkpoint(tmp_path / "ckpt", family)
    path = write_adapter(tmp_path / "a", family, seed=6)
    llm = LLM(str(ckpt), enable_lora=True, max_model_len=96, num_kv_blocks=64, block_size=8, max_loras=1)
    llm.load_lora_adapter("a", str(path))
    p = prompt(9, 31)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    adapted, plain = llm.generate([p, p], greedy, lora_name=["a", None])
    assert kernel_calls  # every step had an adapter on the experts
    assert_matches(adapted, peft_reference(family, path, p, 5))
    assert_matches(plain, peft_reference(family, None, p, 5))
