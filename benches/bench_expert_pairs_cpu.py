"""The CPU expert pass: the Rust kernel (r3srv.kernels.expert_pairs_cpu)
against ops/experts.py's torch path (two torch.mv per (token, slot) pair for a few tokens, the
sorted per-expert GEMMs for many), as same-run ratios.

    .venv/bin/python -m pytest benches/bench_expert_pairs_cpu.py -s

(a) the expert pass alone, 1 and 4 tokens x top-8 of 64 experts (the built-in model's
    shape), float32 and bfloat16, and a float32 prefill's 512 and 2,048 tokens:
    benches/conftest.py prints torch / Rust as reference / r3srv;
(b) the built-in model's whole decode step, 1 and 4 sequences, kernel on and off on the same
    engine (its model's ops selected again for each; the modules' path, without the fused
    decode step, which needs every kernel), interleaved round by round (alternating which goes
    first): median thread-CPU and wall time per step. With 8 sequences a step has 64 pairs, as many as experts, and takes
    the sorted path either way.
Both check the kernel's result against the torch path's (the same greedy tokens in (b)).
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time

import pytest
import torch

from bench_moe import TOP_K, expert_inputs
from engine_testing import model_of, rebound
from r3srv import LLM, SamplingParams, huge_pages, settings
from r3srv.kernels import expert_pairs_cpu
from r3srv.ops import ops_for
from r3srv.ops.experts import SILU_AND_MUL

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "5"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def expert_pass(on: bool):
    """The CPU backend's expert pass with the kernel on or off."""
    with settings.overridden(cpu_expert_kernel=on):
        return ops_for("cpu", torch.float32).experts(SILU_AND_MUL)


def modules_with(llm: LLM, **switches):
    """A switch for interleaved_decode_steps: the settings given None on or off (the others as
    given), the model's ops selected again under them, the modules' path (no fused decode step)."""
    return lambda on: rebound(model_of(llm), fast_cpu_decode=False,
                              **{name: on if value is None else value for name, value in switches.items()})


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_expert_pass(benchmark, tokens, dtype, candidate):
    x, w13, w2, weights, ids = expert_inputs(tokens)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    args = (x, w13, w2, weights, ids.to(torch.int32))
    benchmark.group = f"expert pairs {tokens} tokens x top-{TOP_K} {str(dtype)[6:]}"
    want = expert_pass(False)(*args)  # fewer pairs than experts: the pairs path
    out = benchmark(expert_pass(candidate == "r3srv"), *args)
    # bfloat16: the torch path rounds every intermediate, the kernel its result once
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.03, atol=0.01)
    torch.testing.assert_close(out, want, **tolerance)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("tokens", [512, 2048])
def test_prefill_expert_pass(benchmark, tokens, candidate):
    """A prefill step's float32 expert pass (64 and 256 pairs per expert on average: the
    kernel's wide chunks, pair panels on an AVX2 or AVX-512 CPU) against torch's per-expert
    GEMMs."""
    x, w13, w2, weights, ids = expert_inputs(tokens)
    args = (x, w13, w2, weights, ids.to(torch.int32))
    benchmark.group = f"expert pass, prefill of {tokens} tokens x top-{TOP_K} float32"
    want = expert_pass(False)(*args)
    out = benchmark(expert_pass(candidate == "r3srv"), *args)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)  # two float32 summation orders


PACKED_DTYPES = [
    pytest.param(torch.float32, id="float32", marks=pytest.mark.skipif(
        not expert_pairs_cpu.packs(), reason="this CPU lacks AVX-512F (the packed float32 experts' row tiles)")),
    pytest.param(torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
        not expert_pairs_cpu.packs(torch.bfloat16), reason="this CPU lacks AVX-512 BF16 or runs AMX tiles (the packed "
        "bfloat16 experts' dot products)")),
]


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("tokens", [16, 2048])
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_expert_pass(benchmark, dtype, tokens, candidate):
    """Experts read from their packed copy (r3srv: float32 in row tiles, bfloat16 in panels)
    against their rows read in place (reference): 16 tokens (a decode step's narrow chunks,
    weights cycled over eight layers so that they come from memory) and a prefill's 2,048 (wide
    chunks); the packed pass has the bits of the wide chunks (float32: the pair panels')."""
    x, w13, w2, weights, ids = (t.to(dtype) if i < 3 else t for i, t in enumerate(expert_inputs(tokens)))
    layers = 8 if tokens <= 64 else 1
    params = [tuple(torch.nn.Parameter(w.clone(), requires_grad=False) for w in (w13, w2)) for _ in range(layers)]
    huge_pages.advise([w for pair in params for w in pair])  # as the loader's weights are
    for w13_l, w2_l in params:
        w13_l.data.copy_(w13)
        w2_l.data.copy_(w2)
    ids = ids.to(torch.int32)
    pack = candidate == "r3srv"
    layer = itertools.cycle(params)

    def one_call():
        w13_l, w2_l = next(layer)
        return expert_pairs_cpu.expert_pairs(x, w13_l, w2_l, weights, ids, None, None, None, SILU_AND_MUL, pack=pack)

    for _ in range(layers):  # the copies made before the clock starts
        one_call()
    benchmark.group = f"expert pass, {tokens} tokens x top-{TOP_K} {str(dtype)[6:]}, packed"
    out = benchmark(one_call)
    panels = expert_pairs_cpu.expert_pairs(x, w13, w2, weights, ids, None, None, None, SILU_AND_MUL, wide_min_pairs=1)
    if pack:
        assert torch.equal(out, panels)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, panels, rtol=1e-5, atol=1e-6)
    else:  # a narrow bfloat16 chunk sums in its own order, its result rounded to bfloat16
        torch.testing.assert_close(out, panels, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("num_seqs", [1, 8])
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_decode_step_packed_experts(benchmark, dtype, num_seqs):
    """The built-in model's decode step (the fused layers) with its experts read from their
    packed copy or in place, interleaved on one engine."""
    llm = packed_llms(dtype)
    switch = lambda on: rebound(model_of(llm), packed_experts=on)  # noqa: E731
    med = interleaved_decode_steps(benchmark, llm, num_seqs, switch)
    print(decode_step_report(med, num_seqs, off="rows in place", on="packed"))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8)


@functools.cache
def packed_llms(dtype: torch.dtype) -> LLM:
    """The decode-step engine of `dtype` (one per dtype, kept for the module's cases)."""
    return LLM(max_model_len=512, enable_prefix_caching=False, max_num_seqs=8, dtype=str(dtype)[6:])


def decode_steps(llm: LLM, num_seqs: int, steps: int, round_no: int) -> tuple[list[float], list[float], list]:
    """Per-step (thread CPU, wall) seconds of `steps` decode steps after an untimed prefill,
    and the generated tokens."""
    engine = llm.engine
    prompts = [[32 + (round_no * 31 + s * 17 + i * 13) % 90 for i in range(16)] for s in range(num_seqs)]
    for s, p in enumerate(prompts):
        engine.add_request(f"b{round_no}-{s}-{time.perf_counter_ns()}", p,
                           SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    cpu, wall = [], []
    while engine.has_unfinished():
        c0, w0 = time.thread_time(), time.perf_counter()
        result = engine.step()
        if result.num_prefill_tokens == 0:
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
        for out in result.outputs:
            if out.finished:
                tokens[out.request_id.split("-")[1]] = out.outputs[0].token_ids
    return cpu, wall, [tokens[k] for k in sorted(tokens)]


def interleaved_decode_steps(benchmark, llm: LLM, num_seqs: int, switch, steps: int = 32) -> dict:
    """Median (thread CPU, wall) seconds per decode step with `switch(False)` and `switch(True)`
    (context managers) on one engine, interleaved round by round, alternating which goes first;
    asserts both give the same greedy tokens."""
    per: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    round_no = iter(range(10_000))

    def one_round() -> None:
        r = next(round_no)
        generated = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            with switch(on):
                cpu, wall, generated[on] = decode_steps(llm, num_seqs, steps, r)
            per[on][0].extend(cpu)
            per[on][1].extend(wall)
        assert generated[True] == generated[False]

    with switch(True):
        decode_steps(llm, num_seqs, 4, 9999)  # warm-up
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    med = {on: (statistics.median(c), statistics.median(w)) for on, (c, w) in per.items()}
    benchmark.extra_info.update(cpu_ratio=med[False][0] / med[True][0], wall_ratio=med[False][1] / med[True][1])
    return med


def decode_step_report(med: dict, num_seqs: int, off: str = "torch path", on: str = "Rust kernel") -> str:
    """interleaved_decode_steps' medians as lines to print: the switch off, on, and off / on."""
    lines = [f"\ndecode step, {num_seqs} sequence(s), torch threads {torch.get_num_threads()}, median per step:"]
    for i, what in enumerate(("thread CPU", "wall")):
        lines.append(f"  {what + ':':11s} {off} {med[False][i] * 1e3:.2f} ms, {on} {med[True][i] * 1e3:.2f} ms,"
                     f" {med[False][i] / med[True][i]:.2f}x")
    return "\n".join(lines)


@pytest.mark.parametrize("num_seqs", [1, 4])
def test_decode_step(benchmark, llm, num_seqs):
    switch = modules_with(llm, cpu_expert_kernel=None)
    print(decode_step_report(interleaved_decode_steps(benchmark, llm, num_seqs, switch), num_seqs))
