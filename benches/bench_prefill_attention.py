"""CPU prefill attention: the Rust kernel over a whole step's prompts (kernels/paged_prefill_cpu.py,
`--rust-prefill`) against the torch path it replaces (SDPA per prompt, a chunk after cached
tokens as two flash attentions merged by their log-sum-exps), both as the CPU backend builds them.

    .venv/bin/python -m pytest benches/bench_prefill_attention.py -s

One layer's prefill attention (paged_attention: the K/V write, then the prompts), blocks of 16,
on the built-in model's heads (4 query, 2 KV, head_dim 64) and Qwen3-30B-A3B's (32, 4, 128), in
float32 and bfloat16, at 1 and 2 threads (torch's and the kernel's; on 2 the backend takes the
kernel for large steps only, and the "kernel always" rows show why: torch's OpenMP threads spin
between its ops on the cores the kernel's threads need): one prompt of 512, 16 of 256
in one step (a batch of new requests), a 256-token chunk after 768 cached tokens, one prompt of
1,024 (the longest context the portable kernel takes; longer ones go to SDPA:
RUST_PREFILL_MAX_CONTEXT, unless the dtype's flash kernel runs on this CPU); and on the built-in
model's heads the long prompt of bench_vs_vllm.py as the engine steps it, a prompt of 2,048 and
its next 1,952 tokens after them.
benches/conftest.py prints reference / r3srv; each case checks the two answers agree.
"""

from __future__ import annotations

import functools

import pytest
import torch

import r3srv.ops.attention as attention
from r3srv import settings
from r3srv.kernels import cpu_isa, paged_prefill_cpu
from r3srv.models.batch import ForwardBatch
from r3srv.ops import cpu as cpu_backend
from r3srv.ops import ops_for
from r3srv.ops.attention import span_kernel

BLOCK = 16
HEADS = {"builtin": (4, 2, 64), "qwen3-30b": (32, 4, 128)}
# (prompts, query tokens each, context tokens each)
STEPS = {"1x512": (1, 512, 512), "16x256": (16, 256, 256), "chunk 256 after 768": (1, 256, 1024),
         "1x1024": (1, 1024, 1024), "1x2048": (1, 2048, 2048), "chunk 1952 after 2048": (1, 1952, 4000)}
LONG_STEPS = ("1x2048", "chunk 1952 after 2048")  # the built-in model's heads only: minutes on Qwen3's
CASES = [(model, step) for model in HEADS for step in STEPS if model == "builtin" or step not in LONG_STEPS]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prefill_kernel(on: bool, dtype: torch.dtype, threads: int):
    """The CPU backend's prefill op, the kernel off or on (on more than one thread, while torch's
    OpenMP threads spin between ops, the backend takes it for large steps only: ops/cpu.py's
    RUST_THREADED_PREFILL_MIN_MACS; run with OMP_WAIT_POLICY=PASSIVE for `r3srv serve`'s choice
    beside the kernels' own pool)."""
    with settings.overridden(rust_prefill=on, cpu_threads=threads):
        return ops_for("cpu", dtype).prefill_attention


def kernel_alone(dtype: torch.dtype, threads: int):
    """The kernel's op on `threads` threads whatever the step's size, for the rows that show
    why the backend keeps SDPA for small steps on more than one thread while libgomp spins, and
    not with its passive wait."""
    with settings.overridden(rust_prefill=False, cpu_threads=threads):
        torch_path = ops_for("cpu", dtype).prefill_attention
    kernel = functools.partial(paged_prefill_cpu.paged_prefill_cpu, threads=threads)
    return span_kernel(kernel, cpu_backend.RUST_PREFILL_MAX_CONTEXT, torch_path)


def prefill_batch(prompts: int, queries: int, context: int) -> ForwardBatch:
    """`prompts` sequences, each its last `queries` of `context` tokens this step, in its own blocks."""
    blocks = -(-context // BLOCK)
    table = torch.arange(prompts * blocks, dtype=torch.int32).view(prompts, blocks)
    pos = torch.arange(context - queries, context)
    slots = torch.cat([table[s, pos // BLOCK].long() * BLOCK + pos % BLOCK for s in range(prompts)])
    return ForwardBatch(
        input_ids=torch.zeros(prompts * queries, dtype=torch.int64), positions=pos.repeat(prompts),
        slot_mapping=slots, query_lens=[queries] * prompts, context_lens=[context] * prompts, block_tables=table,
        logits_indices=torch.arange(queries - 1, prompts * queries, queries),
    )


def test_isa_printed():
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    flash = " ".join(sorted(paged_prefill_cpu.FLASH)) or "none"
    print(f"\nprocessor flags: {' '.join(flags)}; flash prefill kernels: {flash}")
    assert "avx2" in flags or not flags  # the kernel's fast path needs AVX2; a portable one runs otherwise


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])  # last in the id: conftest reads it there
@pytest.mark.parametrize("threads", [1, 2, "2 kernel"], ids=["1 thread", "2 threads", "2 threads kernel always"])
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("model, step", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_prefill_attention_layer(benchmark, model, step, dtype, threads, candidate):
    heads, kv_heads, dim = HEADS[model]
    prompts, queries, context = STEPS[step]
    gen = torch.Generator().manual_seed(prompts * 7 + queries)
    batch = prefill_batch(prompts, queries, context)
    slots = batch.block_tables.numel() * BLOCK
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    q = torch.randn(prompts * queries, heads, dim, generator=gen).to(DTYPES[dtype])
    k, v = (torch.randn(prompts * queries, kv_heads, dim, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))

    def layer(kernel):
        return attention.paged_attention(q, k, v, k_cache, v_cache, meta, prefill_kernel=kernel)

    before = torch.get_num_threads()
    count = 2 if threads == "2 kernel" else threads
    torch.set_num_threads(count)
    try:
        want = layer(prefill_kernel(False, DTYPES[dtype], count))
        benchmark.group = f"prefill attention {model} {step} {dtype} {threads}" + ("t" if count == threads else "")
        if candidate == "reference":
            op = prefill_kernel(False, DTYPES[dtype], count)
        elif threads == "2 kernel":
            op = kernel_alone(DTYPES[dtype], count)
        else:
            op = prefill_kernel(True, DTYPES[dtype], count)
        got = benchmark(layer, op)
    finally:
        torch.set_num_threads(before)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
