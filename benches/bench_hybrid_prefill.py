"""Hybrid prefills of many sequences at once (a batch of rollout prompts): the sequences padded
into scan groups and scanned together (r3srv, models/recurrent.py), against one chunked scan per
sequence (the previous implementation, the reference).

    .venv/bin/python -m pytest benches/bench_hybrid_prefill.py

64 prompts of 24-64 tokens through the gated delta rule of one linear-attention layer of
Qwen3.5's per-head shape (key and value heads of 128) with 4 value heads, float32, one thread.
benches/conftest.py prints reference / r3srv. On this CPU grouping LOSES (0.4-0.6x: padding
costs compute, launches cost little), which is why the engine groups only on CUDA
(the backends' scan_pad_factor, ops/cuda.py), where the reference's per-sequence launches dominate:

    python3 benches/bench_hybrid_prefill.py     # on a GPU (benches/gpu_check.sh runs it)

On a GPU that script also times the fused in-place decode step of kernels/recurrent_triton.py
against gathering, stepping and scattering the states as the CPU path does.
"""

from __future__ import annotations

import pytest
import torch

from r3srv.models.batch import ForwardBatch
from r3srv.models.gated_deltanet import chunked_delta_rule, l2_normalize
from r3srv.models.recurrent import LinearStateBatch
from r3srv.ops import cuda

SEQS, HEADS, DIM = 64, 4, 128

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(device="cpu"):
    lengths = torch.randint(24, 65, (SEQS,), generator=torch.Generator().manual_seed(0)).tolist()
    t = sum(lengths)
    g = torch.Generator().manual_seed(1)
    q = l2_normalize(torch.randn(t, HEADS, DIM, generator=g)) * DIM**-0.5
    k = l2_normalize(torch.randn(t, HEADS, DIM, generator=g))
    v = torch.randn(t, HEADS, DIM, generator=g)
    decay = -torch.rand(t, HEADS, generator=g) * 0.1
    beta = torch.rand(t, HEADS, generator=g)
    q, k, v, decay, beta = (x.to(device) for x in (q, k, v, decay, beta))
    batch = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long), positions=torch.zeros(t, dtype=torch.long),
                         slot_mapping=torch.zeros(t, dtype=torch.long), query_lens=lengths, context_lens=lengths,
                         block_tables=torch.zeros(SEQS, 1, dtype=torch.int32), logits_indices=torch.zeros(SEQS, dtype=torch.long))
    states = LinearStateBatch.build(batch, torch.device(device), cuda.SCAN_PAD_FACTOR)  # group as on CUDA
    return states, lengths, (q, k, v, decay, beta)


def per_sequence(states, lengths, inputs):
    out, start = [], 0
    for n in lengths:
        s = torch.zeros(HEADS, DIM, DIM, device=inputs[0].device)
        out.append(chunked_delta_rule(s, *(x[start : start + n].transpose(0, 1) for x in inputs)).transpose(0, 1))
        start += n
    return torch.cat(out)


def grouped(states, lengths, inputs):
    out = torch.empty_like(inputs[2])
    for group in states.scans:
        s = torch.zeros(len(group.lengths), HEADS, DIM, DIM, device=inputs[0].device)
        y = chunked_delta_rule(s, *(group.pad(x).transpose(1, 2) for x in inputs)).transpose(1, 2)
        out[group.rows] = group.take_valid(y)
    return out


@pytest.mark.parametrize("candidate", ["reference", "r3srv"])
def test_hybrid_prefill_of_many_prompts(benchmark, candidate):
    states, lengths, inputs = _step()
    assert len(states.scans) < 4  # a few scan groups, not 64 scans
    torch.testing.assert_close(grouped(states, lengths, inputs), per_sequence(states, lengths, inputs),
                               atol=2e-5, rtol=1e-4)
    benchmark.group = f"hybrid prefill {SEQS} prompts of 24-64 tokens"
    benchmark(per_sequence if candidate == "reference" else grouped, states, lengths, inputs)


if __name__ == "__main__":  # the GPU's ratio (benches/gpu_check.sh)
    import time

    device = "cuda" if torch.cuda.is_available() else "cpu"
    states, lengths, inputs = _step(device)
    timings = {}
    for name, fn in (("per sequence", per_sequence), ("grouped", grouped)):
        fn(states, lengths, inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn(states, lengths, inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - start) / 10
    print(f"hybrid prefill, {SEQS} prompts of 24-64 tokens on {device}: per sequence {timings['per sequence'] * 1e3:.2f} ms, "
          f"grouped {timings['grouped'] * 1e3:.2f} ms, ratio {timings['per sequence'] / timings['grouped']:.1f}x")
    if device == "cuda":  # the decode step: fused in place (kernels/recurrent_triton.py) vs gather-step-scatter
        from r3srv.kernels.recurrent_triton import delta_rule_step_triton
        from r3srv.models.gated_deltanet import recurrent_step

        rows, heads = 64, 32  # Qwen3.5's 32 value heads of 128 x 128
        pool = torch.zeros(3 * rows, heads, DIM, DIM, device=device)
        slots, keep = torch.arange(rows, device=device) * 3, torch.ones(rows, device=device)
        q, k = (l2_normalize(torch.randn(rows, heads, DIM, device=device)) for _ in range(2))
        v, decay, beta = torch.randn(rows, heads, DIM, device=device), -torch.rand(rows, heads, device=device), torch.rand(rows, heads, device=device)

        def gathered():
            s = pool.index_select(0, slots) * keep[:, None, None, None]
            out = recurrent_step(s, q, k, v, decay, beta)
            pool.index_copy_(0, slots, s)
            return out

        steps = {}
        for name, fn in (("gather-step-scatter", gathered),
                         ("fused", lambda: delta_rule_step_triton(pool, slots, keep, q, k, v, decay, beta))):
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            steps[name] = (time.perf_counter() - start) / 20
        print(f"delta-rule decode step, {rows} sequences x {heads} heads of {DIM} x {DIM}: gather-step-scatter "
              f"{steps['gather-step-scatter'] * 1e3:.3f} ms, fused {steps['fused'] * 1e3:.3f} ms, "
              f"ratio {steps['gather-step-scatter'] / steps['fused']:.1f}x")
