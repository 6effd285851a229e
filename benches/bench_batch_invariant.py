"""The cost of --batch-invariant: the same workload on the built-in model through two engines in
one process, the default CPU backend and the batch-invariant one, as a same-run ratio.

    .venv/bin/python benches/bench_batch_invariant.py [rounds]

Workload: 8 prompts of 96 generated tokens each (one prefill step of 768 tokens), then 32 greedy
decode steps of the 8 sequences; prefix caching off. The engines run interleaved round by
round, alternating which goes first, so machine noise hits both alike; the ratio of medians
(invariant / default) of the prefill and of the decode time is printed with the processor's
flags. Never gated on absolute time.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from r3srv import LLM, SamplingParams
from r3srv.kernels import cpu_isa

PROMPTS, PROMPT_LEN, DECODE_STEPS = 8, 96, 32


def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one run: a one-token generation, then the whole one."""
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=DECODE_STEPS + 1))
    return prefill, time.perf_counter() - start - prefill


def main(rounds: int = 5) -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 122) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    engines = {name: LLM(batch_invariant=name == "invariant", enable_prefix_caching=False)
               for name in ("default", "invariant")}
    for llm in engines.values():  # warm-up
        timed(llm, prompts[:2])
    times = {name: ([], []) for name in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            prefill, decode = timed(engines[name], prompts)
            times[name][0].append(prefill)
            times[name][1].append(decode)
    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_isa.cpu_flags())
    print(f"CPU flags {flags}; torch {torch.__version__}; {rounds} rounds; {PROMPTS} x {PROMPT_LEN}-token prompts, "
          f"{DECODE_STEPS} decode steps")
    for i, phase in enumerate(("prefill", "decode")):
        default, invariant = (statistics.median(times[n][i]) for n in ("default", "invariant"))
        print(f"{phase}: default {default * 1e3:.1f} ms, batch-invariant {invariant * 1e3:.1f} ms, "
              f"ratio invariant/default {invariant / default:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
