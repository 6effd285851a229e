"""CPU decode attention: the Rust paged kernel (kernels/paged_decode_cpu.py) against the torch
path it replaces (gather each context out of the paged cache, then SDPA), and the built-in
model's whole decode step with the kernel on and off.

    .venv/bin/python -m pytest benches/bench_paged_decode_cpu.py -s

(a) one layer's decode attention (paged_attention: the K/V write, then the decodes), the built-in
model's shape (4 query heads, 2 KV heads, head_dim 64, float32, blocks of 16), 1 sequence of
512 tokens and 16 of 300; benches/conftest.py prints reference / r3srv.
(b) the built-in model's decode steps (1 sequence after a 512-token prompt, 16 after 300-token
prompts), settings.rust_decode off and on in the same engine (the modules' path: its model's ops
selected again for each, without the fused decode step), interleaved round by round and
alternating which goes first; the ratio of the medians of each step's CPU time on the calling
thread (one torch thread: every op runs there, so other processes on a shared machine barely
disturb it), and the wall-clock ratio next to it. Both also check their answers: the same
attention rows, the same greedy tokens.
(c) one sequence's decode over 4,000 keys (a long prompt's decode steps) on one kernel thread and
on two, eight layers' caches cycled (32 MB: mostly from memory, as in the engine) eight times at
one thread count, then at the other, alternated round by round: the ratio of the medians, one
thread / two (a long context runs in parts the threads take in turn); both give the same bits.
(d) one layer's decode attention on Qwen3-30B-A3B's attention shape (32 query heads, 4 KV heads,
head_dim 128: GQA groups of eight) in bfloat16, 16 sequences of 2,000 keys, the kernel against
the torch path (benches/conftest.py prints reference / r3srv), with the kernel's read rate and
multiply-add rate, the CPU's flags and the kernel's ISA printed: the shape of real MoE models'
long rollouts, whose groups of eight take the kernel's blocks of eight heads on AVX-512 and
their scores in AVX-512 BF16 dot products where the CPU has them (ISA "avx512_bf16").
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

import r3srv.ops.attention as attention
from bench_expert_pairs_cpu import modules_with
from r3srv import LLM, SamplingParams, _core, settings
from r3srv.kernels.paged_decode_cpu import paged_decode_cpu
from r3srv.models.batch import ForwardBatch
from r3srv.ops import ops_for

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 64
SHAPES = [(1, 512), (16, 300)]
ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "6"))
DECODE_STEPS = 32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def decode_kernel(on: bool):
    """The CPU backend's paged decode kernel with settings.rust_decode on (None off: gather + SDPA)."""
    with settings.overridden(rust_decode=on):
        return ops_for("cpu", torch.float32).decode_attention


def decode_batch(seqs: int, context: int) -> ForwardBatch:
    """`seqs` sequences decoding their token `context` (each context in its own blocks)."""
    blocks = -(-context // BLOCK)
    table = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks)
    pos = context - 1
    return ForwardBatch(
        input_ids=torch.zeros(seqs, dtype=torch.int64), positions=torch.full((seqs,), pos),
        slot_mapping=table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK, query_lens=[1] * seqs,
        context_lens=[context] * seqs, block_tables=table, logits_indices=torch.arange(seqs),
    )


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])  # last in the id: conftest reads it there
@pytest.mark.parametrize("seqs, context", SHAPES, ids=[f"{s}x{c}" for s, c in SHAPES])
def test_decode_attention_layer(benchmark, candidate, seqs, context):
    gen = torch.Generator().manual_seed(seqs)
    batch = decode_batch(seqs, context)
    slots = batch.block_tables.numel() * BLOCK
    k_cache, v_cache = (torch.randn(slots, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q = torch.randn(seqs, HEADS, DIM, generator=gen)
    k, v = (torch.randn(seqs, KV_HEADS, DIM, generator=gen) for _ in range(2))
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))

    def layer(kernel):
        return attention.paged_attention(q, k, v, k_cache, v_cache, meta, decode_kernel=kernel)

    want = layer(decode_kernel(False))
    benchmark.group = f"decode attention {seqs} x {context}"
    got = benchmark(layer, decode_kernel(candidate == "r3srv"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


QWEN3_HEADS, QWEN3_KV_HEADS, QWEN3_DIM = 32, 4, 128


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_decode_attention_layer_of_groups_of_eight(benchmark, candidate):
    from r3srv.kernels import cpu_isa

    seqs, context, dtype = 16, 2000, torch.bfloat16
    gen = torch.Generator().manual_seed(8)
    batch = decode_batch(seqs, context)
    slots = batch.block_tables.numel() * BLOCK
    k_cache, v_cache = (torch.randn(slots, QWEN3_KV_HEADS, QWEN3_DIM, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(seqs, QWEN3_HEADS, QWEN3_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(seqs, QWEN3_KV_HEADS, QWEN3_DIM, generator=gen).to(dtype) for _ in range(2))
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))

    def layer(kernel):
        return attention.paged_attention(q, k, v, k_cache, v_cache, meta, decode_kernel=kernel)

    want = layer(decode_kernel(False)).float()
    benchmark.group = f"decode attention, groups of eight, bfloat16 {seqs} x {context}"
    got = benchmark(layer, decode_kernel(candidate == "r3srv"))
    torch.testing.assert_close(got.float(), want, rtol=2**-6, atol=2e-2)  # bfloat16 outputs, rounded apart
    if benchmark.stats is None:  # --benchmark-disable (make bench-smoke): one call, nothing timed
        return
    seconds = benchmark.stats.stats.median
    reads = 2 * seqs * context * QWEN3_KV_HEADS * QWEN3_DIM * dtype.itemsize
    macs = 2 * seqs * context * QWEN3_HEADS * QWEN3_DIM
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"\n{candidate}: {seconds * 1e3:.2f} ms a layer, {reads / seconds / 1e9:.1f} GB/s of KV cache, "
          f"{2 * macs / seconds / 1e9:.1f} GFLOPS; CPU flags {flags}; the kernel's ISA {_core.paged_decode_isa()}")


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=8192)


def decode_steps(llm: LLM, prompts: list[list[int]]) -> tuple[list[float], list[float], list[list[int]]]:
    """Each decode step's (wall, thread CPU) seconds after the prompts' prefill, and the tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.step().num_prefill_tokens == 0:  # the prefill step, untimed
        pass
    walls, cpus, tokens = [], [], {}
    while engine.has_unfinished():
        w0, c0 = time.perf_counter(), time.thread_time()
        step = engine.step()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
        tokens.update((o.request_id, o.outputs[0].token_ids) for o in step.outputs if o.finished)
    return walls, cpus, [tokens[rid] for rid in ids]


@pytest.mark.parametrize("seqs, context", SHAPES, ids=[f"{s}x{c}" for s, c in SHAPES])
def test_decode_step_kernel_on_vs_off(benchmark, llm, seqs, context):
    steps: dict[bool, tuple[list[float], list[float]]] = {}
    rounds = iter(range(10_000))
    switch = modules_with(llm, rust_decode=None)

    def one_round():
        r = next(rounds)
        prompts = [[32 + (r * 31 + s * 17 + i * 13) % 90 for i in range(context)] for s in range(seqs)]
        tokens = {}
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            with switch(on):
                walls, cpus, tokens[on] = decode_steps(llm, prompts)
            steps[on][0].extend(walls)
            steps[on][1].extend(cpus)
        assert tokens[True] == tokens[False]  # the kernel changes no greedy token

    if not benchmark.disabled:  # bench-smoke runs the one (checked) round only
        steps.update({False: ([], []), True: ([], [])})
        one_round()  # warm-up
    steps.update({False: ([], []), True: ([], [])})
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    wall = {on: statistics.median(s[0]) for on, s in steps.items()}
    cpu = {on: statistics.median(s[1]) for on, s in steps.items()}
    benchmark.extra_info.update(cpu_ratio=cpu[False] / cpu[True], wall_ratio=wall[False] / wall[True])
    print(f"\ndecode step, {seqs} x {context} (torch threads {torch.get_num_threads()}), medians of "
          f"{len(steps[True][1])} steps each:\n"
          f"  thread CPU: off {cpu[False] * 1e3:.2f} ms, on {cpu[True] * 1e3:.2f} ms, off/on {cpu[False] / cpu[True]:.2f}x\n"
          f"  wall:       off {wall[False] * 1e3:.2f} ms, on {wall[True] * 1e3:.2f} ms, off/on {wall[False] / wall[True]:.2f}x")


LONG_CONTEXT, LONG_LAYERS = 4000, 8
LONG_PASSES = 8  # a round's passes over the layers at one thread count, then at the other


def test_a_long_context_on_one_and_two_threads(benchmark):
    gen = torch.Generator().manual_seed(4000)
    batch = decode_batch(1, LONG_CONTEXT)
    slots = batch.block_tables.numel() * BLOCK
    caches = [[torch.randn(slots, KV_HEADS, DIM, generator=gen) for _ in range(2)] for _ in range(LONG_LAYERS)]
    q = torch.randn(1, HEADS, DIM, generator=gen)
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))
    tables, lens, rows, _ = meta.decode_kernel_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    outs: dict[int, list[torch.Tensor]] = {1: [], 2: []}

    def one_round():
        r = len(times[1])
        for threads in ((1, 2) if r % 2 == 0 else (2, 1)):
            for k_cache, v_cache in caches * LONG_PASSES:
                out = torch.empty(1, HEADS, DIM)
                t0 = time.perf_counter()
                paged_decode_cpu(q, k_cache, v_cache, tables, lens, rows, out, page=BLOCK, scale=DIM ** -0.5,
                                 threads=threads)
                times[threads].append(time.perf_counter() - t0)
                outs[threads].append(out)

    one_round()  # warm-up, and checked below too
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[2]))  # the parts' bits on any thread count
    one, two = (statistics.median(times[t]) for t in (1, 2))
    benchmark.extra_info.update(one_over_two=one / two)
    print(f"\ndecode attention, 1 x {LONG_CONTEXT} keys, {LONG_LAYERS} layers' caches cycled, medians of "
          f"{len(times[1])} calls: one thread {one * 1e3:.3f} ms, two {two * 1e3:.3f} ms, one/two {one / two:.2f}x")
