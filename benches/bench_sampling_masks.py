"""What sampling masks cost a decode step's sampling: the same batch of B sampled rows
(temperature 1, top-k 50, top-p 0.9, as RL rollouts sample) with masks off ("reference") and on
("r3srv"), in one run; the ratio is below 1 by the masks' cost (the support read back to the
host: one nonzero, one gather, one copy per step for the whole batch).

    .venv/bin/python -m pytest benches/bench_sampling_masks.py

benches/conftest.py prints reference / r3srv and the processor's ISA.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.engine.sampler import sample
from r3srv.engine.sequence import Sequence
from r3srv.sampling_params import SamplingParams

SHAPES = [(64, 259), (64, 32768), (256, 32768)]  # (sequences, vocabulary); 259: the built-in model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
@pytest.mark.parametrize("rows, vocab", SHAPES, ids=[f"{b}x{v}" for b, v in SHAPES])
def test_sample_with_masks(benchmark, rows, vocab, candidate):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab)) * 3
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, return_sampling_mask=candidate == "r3srv")
    seqs = [Sequence(str(i), 0, [1], params, 8, None) for i in range(rows)]
    benchmark.group = f"sample+mask {rows}x{vocab}"
    results = benchmark(sample, logits, seqs, [], torch.Generator().manual_seed(0))
    assert len(results) == rows
    for res in results:
        if candidate == "r3srv":
            assert res.token_id in res.mask_ids.tolist() and 1 <= len(res.mask_ids) <= 50
        else:
            assert res.mask_ids is None
