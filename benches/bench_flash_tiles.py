"""The float32 flash prefill kernel in AVX2 tiles (rust/src/paged_prefill_f32.rs), at every
context length, against what an AVX2-only CPU ran without them: the portable kernel for contexts
up to RUST_PREFILL_MAX_CONTEXT (1,024 tokens), SDPA per prompt beyond; and, where this CPU has
AVX-512F too, the kernel's AVX-512 tiles beside them (the `avx512` rows: the same bits, the same
arithmetic in wider registers). The rows up to 1,024 are the AVX2 tiles' work on such a CPU (they
replace the portable kernel there); the longer ones show why SDPA keeps those.

    .venv/bin/python -m pytest benches/bench_flash_tiles.py -s

One layer's prefill attention (paged_attention: the K/V write, then the prompts), blocks of 16,
on the built-in model's heads (4 query, 2 KV, head_dim 64) and Qwen3-30B-A3B's (32, 4, 128), at 1
and 2 threads (torch's and the kernel's), over bench_prefill_attention.py's steps. On an
AVX-512 CPU this measures AVX2 code on it: on AMD Zen 4 both widths run the same multiply-adds
a cycle, on Intel AVX-512 parts the AVX2 tiles run at about half the AVX-512 ones' rate.
benches/conftest.py prints reference / r3srv; each case checks the answers agree.
"""

from __future__ import annotations

import functools

import pytest
import torch

import r3srv.ops.attention as attention
from r3srv import settings
from r3srv.kernels import cpu_isa, paged_prefill_cpu
from r3srv.ops import cpu as cpu_backend
from r3srv.ops import ops_for
from r3srv.ops.attention import span_kernel

from bench_prefill_attention import BLOCK, CASES, HEADS, STEPS, prefill_batch

TILES = [t for t, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if needs <= cpu_isa.cpu_flags()]
pytestmark = pytest.mark.skipif("avx2" not in TILES, reason="this CPU lacks AVX2 with FMA (the AVX2 tiles)")


def test_isa_printed():
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"\nprocessor flags: {' '.join(flags)}; float32 flash tiles this CPU runs: {' '.join(TILES)}")
    assert "avx2" in TILES


def op(kernel: str, threads: int):
    """The prefill op on `threads` threads: paged_prefill_cpu's `kernel` where it takes the step
    (the portable kernel to RUST_PREFILL_MAX_CONTEXT, flash tiles at any length), SDPA otherwise."""
    with settings.overridden(rust_prefill=False, cpu_threads=threads):
        torch_path = ops_for("cpu", torch.float32).prefill_attention
    limit = cpu_backend.RUST_PREFILL_MAX_CONTEXT if kernel == "portable" else None
    return span_kernel(functools.partial(paged_prefill_cpu.paged_prefill_cpu, threads=threads, kernel=kernel),
                       limit, torch_path)


@pytest.mark.parametrize("candidate", ["reference", "r3srv", "avx512"])  # last in the id: conftest reads it there
@pytest.mark.parametrize("threads", [1, 2], ids=["1 thread", "2 threads"])
@pytest.mark.parametrize("model, step", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_float32_prefill_attention_layer(benchmark, model, step, threads, candidate):
    if candidate == "avx512" and "avx512" not in TILES:
        pytest.skip("this CPU lacks AVX-512F (the AVX-512 tiles)")
    heads, kv_heads, dim = HEADS[model]
    prompts, queries, context = STEPS[step]
    gen = torch.Generator().manual_seed(prompts * 7 + queries)
    batch = prefill_batch(prompts, queries, context)
    slots = batch.block_tables.numel() * BLOCK
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(prompts * queries, heads, dim, generator=gen)
    k, v = (torch.randn(prompts * queries, kv_heads, dim, generator=gen) for _ in range(2))
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))

    def layer(kernel):
        return attention.paged_attention(q, k, v, k_cache, v_cache, meta, prefill_kernel=kernel)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = layer(op("portable", threads))
        benchmark.group = f"float32 prefill attention {model} {step} {threads}t"
        kernel = {"reference": "portable", "r3srv": "avx2", "avx512": "avx512"}[candidate]
        got = benchmark(layer, op(kernel, threads))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
