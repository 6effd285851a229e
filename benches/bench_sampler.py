"""Sampling one token for B unseeded sequences (temperature 1, as RL rollouts sample, with and
without top-p 0.9): the batched sampler against the per-row sampler it replaced.

    .venv/bin/python -m pytest benches/bench_sampler.py

The reference is the previous code path: per row, temperature, softmax and a multinomial
draw from the row's own generator (3 ops a row; on a GPU each is a kernel launch). r3srv
draws every unseeded row in one batched pass. benches/conftest.py prints reference / r3srv.
Measured here: 3.1-4.2x at 64 x 259, 3.4-5.3x at 256 x 259 (per-op overhead dominates), and
0.8-1.1x at 64 x 32,768, where the work is the draw itself and the per-row passes keep a row
in cache between ops while the batched ones stream [B, 32k] from memory.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.engine.sampler import sample
from r3srv.engine.sequence import Sequence
from r3srv.sampling_params import SamplingParams

SHAPES = [(64, 259), (256, 259), (64, 32768)]  # (sequences, vocabulary); 259: the built-in model


def per_row_reference(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    picks = []
    for i, s in enumerate(seqs):
        row = logits[i] / s.params.temperature
        if s.params.top_p < 1.0:  # the previous per-row nucleus filter
            sorted_logits, order = torch.sort(row, descending=True, stable=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            row = row.clone()
            row[order[(torch.cumsum(probs, dim=-1) - probs) >= s.params.top_p]] = float("-inf")
        picks.append(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=s.generator))
    return torch.cat(picks).tolist()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("rows, vocab", SHAPES, ids=[f"{b}x{v}" for b, v in SHAPES])
def test_sample_unseeded_rows(benchmark, rows, vocab, top_p, candidate):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    params = SamplingParams(temperature=1.0, top_p=top_p)
    benchmark.group = f"sample {rows}x{vocab} p={top_p}"
    if candidate == "reference":  # before: every sampled sequence had its own generator
        seqs = [Sequence(str(i), 0, [1], params, 8, torch.Generator().manual_seed(i)) for i in range(rows)]
        picks = benchmark(per_row_reference, logits, seqs)
    else:
        seqs = [Sequence(str(i), 0, [1], params, 8, None) for i in range(rows)]
        shared = torch.Generator().manual_seed(0)
        picks = [r.token_id for r in benchmark(sample, logits, seqs, [], shared)]
    assert len(picks) == rows and all(0 <= t < vocab for t in picks)


ADJUSTED = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                          logit_bias={7: 2.0}, min_p=0.05)


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("rows, vocab", SHAPES, ids=[f"{b}x{v}" for b, v in SHAPES])
def test_sample_with_some_penalized_rows(benchmark, rows, vocab, candidate):
    """What penalties, logit_bias and min_p on one row in 8 (each with 512 output tokens) cost
    a batch: "reference" is the same batch with none (the ratio is below 1 by that cost)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    plain = SamplingParams(temperature=1.0)
    benchmark.group = f"sample {rows}x{vocab} 1/8 penalized"
    seqs = []
    for i in range(rows):
        params = ADJUSTED if candidate == "r3srv" and i % 8 == 0 else plain
        seq = Sequence(str(i), 0, list(range(64)), params, 1024, None)
        seq.token_ids += [(i * 7 + j) % vocab for j in range(512)]
        seqs.append(seq)
    shared = torch.Generator().manual_seed(0)
    picks = [r.token_id for r in benchmark(sample, logits, seqs, [], shared)]
    assert len(picks) == rows and all(0 <= t < vocab for t in picks)
