"""The bfloat16 prefill attention in AMX tiles (rust/src/flash_amx.rs) against what the CPU
backend ran on such a processor before them, torch's SDPA path (on torch's own AMX kernels), and
against the same kernel's AVX-512 BF16 dot products, as same-run ratios:
    .venv/bin/python benches/bench_amx_attention.py [--threads 1 2] [--rounds 7]
One layer's prefill attention (paged_attention: the K/V write, then the step's spans) on the
built-in model's heads (4 query, 2 KV, head_dim 64) and Qwen3-30B-A3B's (32, 4, 128), over
bench_prefill_attention.py's steps and the 4,000-token prompt's two chunks; the paths alternated
round by round (who goes first too); prints the processor's matrix extensions and, per step, the
medians of the per-round ratios SDPA / AMX tiles and dot products / AMX tiles (> 1: the tiles are
faster) with their ranges. The three results are checked against each other within bfloat16's
tolerance. Where the CPU lacks AMX-BF16 (or Linux does not grant the tiles) it says so and
measures nothing. A benchmark, not a gate: under pytest (`make bench-smoke`) it runs one small
round.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import amx_bench  # noqa: E402
import r3srv.ops.attention as attention  # noqa: E402
from r3srv import settings  # noqa: E402
from r3srv.kernels import paged_prefill_cpu  # noqa: E402
from r3srv.ops import ops_for  # noqa: E402
from r3srv.ops.attention import span_kernel  # noqa: E402

from bench_prefill_attention import BLOCK, HEADS, STEPS, prefill_batch  # noqa: E402

# prompts, queries a prompt, context a prompt: bench_prefill_attention's steps, among them the
# long workload's prompt as the engine chunks it
CASES = ([("builtin", step) for step in STEPS]
         + [("qwen3-30b", step) for step in ("1x512", "16x256", "chunk 256 after 768")])
PATHS = ("sdpa", "avx512", "amx")


def layer_inputs(model: str, step: str):
    heads, kv_heads, dim = HEADS[model]
    prompts, queries, context = STEPS[step]
    gen = torch.Generator().manual_seed(prompts * 7 + queries)
    batch = prefill_batch(prompts, queries, context)
    slots = batch.block_tables.numel() * BLOCK
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(prompts * queries, heads, dim, generator=gen).bfloat16()
    k, v = (torch.randn(prompts * queries, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    meta = attention.AttentionMetadata.build(batch, BLOCK, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


def op(path: str, threads: int):
    """The prefill op: torch's path (SDPA per prompt), or the Rust flash kernel in `path`'s tiles."""
    with settings.overridden(rust_prefill=False, cpu_threads=threads):
        torch_path = ops_for("cpu", torch.bfloat16).prefill_attention
    if path == "sdpa":
        return torch_path
    return span_kernel(functools.partial(paged_prefill_cpu.paged_prefill_cpu, threads=threads, kernel=path), None,
                       torch_path)


def compare(model: str, step: str, threads: int, rounds: int) -> dict[str, list[float]]:
    """Per-round ratios sdpa / amx and avx512 / amx; checks the three results agree."""
    q, k, v, k_cache, v_cache, meta = layer_inputs(model, step)
    ops = {path: op(path, threads) for path in PATHS}

    def layer(path):
        start = time.perf_counter()
        out = attention.paged_attention(q, k, v, k_cache, v_cache, meta, prefill_kernel=ops[path])
        return time.perf_counter() - start, out

    outs = {path: layer(path)[1] for path in PATHS}  # warm, and the answers
    for path in ("sdpa", "avx512"):
        torch.testing.assert_close(outs[path].float(), outs["amx"].float(), atol=2e-2, rtol=2e-2)
    ratios = {"sdpa": [], "avx512": []}
    for r in range(rounds):
        took = {path: layer(path)[0] for path in (PATHS if r % 2 == 0 else PATHS[::-1])}
        for path in ratios:
            ratios[path].append(took[path] / took["amx"])
    return ratios


def runs_here() -> str | None:
    """None where the three paths run here, else why not."""
    if not paged_prefill_cpu.BUILT:
        return "the Rust extension lacks the prefill kernel"
    if paged_prefill_cpu.flash_tiles(torch.bfloat16) != "amx":
        return "this CPU (or its kernel) does not run AMX-BF16 tiles (or --no-amx-tiles)"
    return None


def main() -> None:
    def measure(threads: int, rounds: int) -> None:
        for model, step in CASES:
            ratios = compare(model, step, threads, rounds)
            print(f"{model} {step}, {threads} thread(s): "
                  + "; ".join(f"{path} / AMX tiles {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                              for path, r in ratios.items())
                  + f", {rounds} rounds", flush=True)

    amx_bench.main(__doc__, runs_here, measure)


def test_amx_attention_against_sdpa_and_dot_products(one_torch_thread):
    import pytest

    why = runs_here()
    if why:
        pytest.skip(why)
    ratios = compare("builtin", "1x512", 1, 1)
    assert all(len(r) == 1 for r in ratios.values())


if __name__ == "__main__":
    main()
