"""Engine throughput on the built-in model, routed experts on vs off, as same-run ratios.

    .venv/bin/python -m pytest benches/bench_engine.py -s

(a) prefill: 4 prompts x 256 tokens, one generated token each;
(b) batched decode: 8 sequences, 64 decode steps (decode steps timed on their own);
(c) single-sequence decode: 1 sequence, 128 decode steps (the >= 50 tokens/s check).

Both engines (capture on, capture off) live in the same process with prefix caching off,
and run interleaved round by round, alternating which goes first, so machine noise hits
both alike. Target: capture costs at most 3% (ratio of medians on/off <= 1.03).
R3SRV_BENCH_THREADS sets torch's intra-op threads (default: 1; see the report printed).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from r3srv import LLM, SamplingParams

ROUNDS = int(os.environ.get("R3SRV_BENCH_ROUNDS", "7"))
THREADS = int(os.environ.get("R3SRV_BENCH_THREADS", "1"))
TARGET_OVERHEAD = 0.03


@pytest.fixture(scope="module")
def engines():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    common = dict(max_model_len=1024, enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=4096)
    on = LLM(enable_return_routed_experts=True, **common)
    off = LLM(enable_return_routed_experts=False, **common)
    yield {"off": off, "on": on}
    torch.set_num_threads(before)


def prompts(n: int, length: int, round_no: int) -> list[list[int]]:
    return [[32 + (round_no * 31 + s * 17 + i * 13) % 90 for i in range(length)] for s in range(n)]


def timed_decode(llm: LLM, batch: list[list[int]], steps: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps only: the prefill step runs first, untimed."""
    engine = llm.engine
    for i, p in enumerate(batch):
        engine.add_request(f"d{time.perf_counter_ns()}-{i}", p, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    while engine.step().num_prefill_tokens == 0:  # until the prefill step has run
        pass
    tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        tokens += engine.step().num_decode_tokens
    return time.perf_counter() - t0, tokens


def run_interleaved(benchmark, engines, one) -> dict[str, list[float]]:
    """one(llm, round_no) -> tokens/s; returns tokens/s per engine per round."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    round_no = iter(range(10_000))
    for name in ("off", "on"):  # warm-up
        one(engines[name], 9999)

    def one_round() -> None:
        r = next(round_no)
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for name in order:
            rates[name].append(one(engines[name], r))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    return rates


def report(benchmark, title: str, rates: dict[str, list[float]]) -> float:
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = med["off"] / med["on"] - 1.0  # time ratio on/off minus one
    benchmark.extra_info.update({f"tokens_per_s_{k}": v for k, v in med.items()})
    benchmark.extra_info["overhead"] = overhead
    print(
        f"\n{title}: capture off {med['off']:.0f} tok/s, on {med['on']:.0f} tok/s, "
        f"overhead {100 * overhead:+.2f}% (target <= {100 * TARGET_OVERHEAD:.0f}%), torch threads {torch.get_num_threads()}"
    )
    return overhead


def test_prefill_throughput(benchmark, engines):
    def one(llm: LLM, r: int) -> float:
        batch = prompts(4, 256, r)
        t0 = time.perf_counter()
        outs = llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        return 4 * 256 / dt

    rates = run_interleaved(benchmark, engines, one)
    report(benchmark, "(a) prefill 4 x 256 tokens", rates)


def test_batched_decode_throughput(benchmark, engines):
    def one(llm: LLM, r: int) -> float:
        dt, tokens = timed_decode(llm, prompts(8, 16, r), 64)
        assert tokens == 8 * 64
        return tokens / dt

    rates = run_interleaved(benchmark, engines, one)
    report(benchmark, "(b) decode 8 sequences", rates)


def test_single_sequence_decode(benchmark, engines):
    def one(llm: LLM, r: int) -> float:
        dt, tokens = timed_decode(llm, prompts(1, 16, r), 128)
        assert tokens == 128
        return tokens / dt

    rates = run_interleaved(benchmark, engines, one)
    report(benchmark, "(c) decode 1 sequence", rates)
    print(f"(c) single-sequence decode with capture on: {statistics.median(rates['on']):.0f} tok/s (need >= 50)")
