"""The bfloat16 expert pass of a prefill in AMX tiles against the AVX-512 BF16 dot products, the
same Rust kernel either way (settings.amx_tiles), as a same-run ratio:

    .venv/bin/python benches/bench_amx_experts.py [--threads 1 2] [--rounds 7]

The built-in model's shape (64 experts, top-8, hidden 256, intermediate 128) at 512, 2,048 and
4,000 tokens, the two paths alternated round by round (who goes first too); prints the processor's
matrix extensions and, per size, the median of the per-round ratios dot products / tiles (> 1:
the tiles are faster) with their range. Both results are checked against each other within the
float32 rounding of their sums. Where the CPU lacks AMX-BF16 (or Linux does not grant the tiles)
it says so and measures nothing. A benchmark, not a gate: under pytest (`make bench-smoke`) it
runs one small round.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import amx_bench  # noqa: E402
from r3srv.kernels import expert_pairs_cpu  # noqa: E402
from r3srv.ops.experts import SILU_AND_MUL  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 64, 8, 256, 128
SIZES = (512, 2048, 4000)


def inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05).bfloat16()
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, EXPERTS, generator=g), -1), TOP_K)
    return x, w13, w2, weights, ids.to(torch.int32)


def one_pass(args, tiles: bool, threads: int) -> tuple[float, torch.Tensor]:
    expert_pairs_cpu.allow_amx(tiles)
    assert expert_pairs_cpu.bf16_products() == ("amx" if tiles else "avx512_bf16")
    start = time.perf_counter()
    out = expert_pairs_cpu.expert_pairs(*args, None, None, None, SILU_AND_MUL, threads=threads)
    return time.perf_counter() - start, out


def compare(tokens: int, threads: int, rounds: int) -> list[float]:
    """Per-round ratios dot products / tiles; checks the two results agree."""
    args = inputs(tokens)
    for tiles in (True, False):  # warm: buffers, page faults
        one_pass(args, tiles, threads)
    ratios = []
    try:
        for r in range(rounds):
            took = {}
            for tiles in ((True, False) if r % 2 == 0 else (False, True)):
                took[tiles], out = one_pass(args, tiles, threads)
                took[tiles, "out"] = out
            ratios.append(took[False] / took[True])
        a, b = took[True, "out"].double(), took[False, "out"].double()
        # both within float32 sums' rounding of the same bfloat16 products, rounded once to bfloat16
        assert ((a - b).abs() <= 2**-7 * b.abs() + 1e-3).all(), "the tiles' and the dot products' results disagree"
    finally:
        expert_pairs_cpu.allow_amx(True)
    return ratios


def runs_here() -> str | None:
    """None where both paths run here, else why not."""
    if not expert_pairs_cpu.BUILT:
        return "the Rust extension lacks the expert kernel"
    expert_pairs_cpu.allow_amx(True)
    if expert_pairs_cpu.bf16_products() != "amx":
        return "this CPU (or its kernel) does not run AMX-BF16 tiles"
    return None


def main() -> None:
    def measure(threads: int, rounds: int) -> None:
        for tokens in SIZES:
            ratios = compare(tokens, threads, rounds)
            print(f"{tokens:5d} tokens, {threads} thread(s): dot products / AMX tiles {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}), {len(ratios)} rounds", flush=True)

    amx_bench.main(__doc__, runs_here, measure)


def test_amx_tiles_against_dot_products(one_torch_thread):
    import pytest

    why = runs_here()
    if why:
        pytest.skip(why)
    assert len(compare(512, 1, 1)) == 1


if __name__ == "__main__":
    main()
