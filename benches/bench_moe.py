"""The MoE expert pass: two grouped GEMMs against the per-expert loop, on the built-in model's
shapes (64 experts, top-8, hidden 256, expert width 128).

    .venv/bin/python -m pytest benches/bench_moe.py

Rows per expert 1 and 16 are the decode batches where the engine takes the grouped path on
the CPU (benches/conftest.py prints loop / grouped as reference / r3srv). On a GPU the
grouped path also drops the loop's device sync per layer: unmeasured here.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.ops import experts as moe
from r3srv.ops.experts import TorchExperts

EXPERTS, TOP_K, HIDDEN, INTER = 64, 8, 256, 128
TOKENS = [8, 128]  # 1 and 16 rows per expert


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def expert_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, weights, ids of the built-in model's shapes for `tokens` tokens (seeded)."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.05
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.05
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), -1), TOP_K)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_expert_pass(benchmark, tokens, candidate):
    x, w13, w2, weights, ids = expert_inputs(tokens)
    flat = ids.reshape(-1)
    rows = x.index_select(0, torch.argsort(flat, stable=True) // TOP_K)
    counts = torch.bincount(flat, minlength=EXPERTS)
    assert TorchExperts(grouped="cpu").uses_grouped_mm(rows, w2)  # the CPU backend's choice
    benchmark.group = f"experts {tokens} tokens x top-{TOP_K}"
    run = moe.expert_mlps_looped if candidate == "reference" else moe.expert_mlps_grouped
    out = benchmark(run, rows, w13, w2, counts)
    assert torch.equal(out, moe.expert_mlps_looped(rows, w13, w2, counts))  # bitwise, either way
