"""Decode throughput with overlapped scheduling (async_scheduling) vs without, as a same-run ratio.

    .venv/bin/python -m pytest benches/bench_overlap.py -s

Two engines on the built-in model (routed experts on, prefix caching off) live in one process
and run interleaved round by round, alternating which goes first. Each round generates
SEQS sequences of DECODE tokens from short prompts (decode-bound) and times the whole
generate. Printed: the median ratio overlapped / plain of output tokens per second, with its
min and max. The overlap hides the host's scheduling, input building and output bookkeeping
behind the forward; on a shared 2-core CPU the forward and the host compete for the same
cores (and for the GIL between torch ops), so a ratio near 1 is expected there: the gain is a
GPU's, where the forward does not need the host.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from r3srv import LLM, SamplingParams

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "5"))
SEQS = int(os.environ.get("R3SRV_BENCH_SEQS", "16"))
DECODE = int(os.environ.get("R3SRV_BENCH_DECODE", "64"))
THREADS = int(os.environ.get("R3SRV_BENCH_THREADS", "1"))


@pytest.fixture(scope="module")
def engines():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    common = dict(max_model_len=512, enable_prefix_caching=False, max_num_seqs=SEQS)
    yield {"plain": LLM(**common), "overlapped": LLM(async_scheduling=True, **common)}
    torch.set_num_threads(before)


def test_decode_throughput_overlapped_vs_plain(engines, request):
    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    tps: dict[str, list[float]] = {name: [] for name in engines}
    # CI's smoke run (--benchmark-disable) only checks that it runs: one timed round
    rounds = 1 if request.config.getoption("benchmark_disable", default=False) else ROUNDS
    for round_no in range(rounds + 1):  # round 0 warms up
        prompts = [[32 + (round_no * 31 + s * 17 + i * 13) % 90 for i in range(16)] for s in range(SEQS)]
        order = list(engines) if round_no % 2 else list(reversed(engines))
        tokens = {}
        for name in order:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            elapsed = time.perf_counter() - t0
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            if round_no:
                tps[name].append(SEQS * DECODE / elapsed)
        assert tokens["overlapped"] == tokens["plain"]  # same greedy tokens, whatever the speed
    ratios = [o / p for o, p in zip(tps["overlapped"], tps["plain"])]
    print(
        f"\ndecode throughput, {SEQS} sequences x {DECODE} tokens, {THREADS} torch thread(s), {rounds} rounds:"
        f"\n  plain      median {statistics.median(tps['plain']):8.1f} tok/s"
        f"\n  overlapped median {statistics.median(tps['overlapped']):8.1f} tok/s"
        f"\n  overlapped / plain: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
