"""Which conditions change a request's logprobs, in the default mode and under --batch-invariant
(docs/replay.md, "Determinism"): the built-in model, greedy, 12 tokens of a 40-token prompt,
against the same request alone, cold, in a fresh engine.

    .venv/bin/python benches/measure_determinism.py

Prints, per condition and mode: the largest |logprob difference|, the first decode step that
differs, and whether the tokens and the routed-experts rows are equal.
"""

from __future__ import annotations

import random

import numpy as np

from r3srv import LLM, SamplingParams
from r3srv.settings import overridden

PROMPT = [random.Random(1).randrange(32, 122) for _ in range(40)]
PARAMS = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=0)


def sample(output):
    s = output.outputs[0]
    return s.token_ids, [step[t].logprob for step, t in zip(s.logprobs, s.token_ids)], s.routed_experts


def others(n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(32, 122) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def again(options: dict) -> object:
    """The request a second time in the same engine (over the prefix cache when it is on)."""
    llm = LLM(**options)
    llm.generate([PROMPT], PARAMS)
    return sample(llm.generate([PROMPT], PARAMS)[0])


def in_batch(options: dict, n: int = 8) -> object:
    return sample(LLM(enable_prefix_caching=False, **options).generate([*others(n), PROMPT], PARAMS)[-1])


def chunked(options: dict, chunk: int = 16) -> object:
    return sample(LLM(enable_prefix_caching=False, max_num_batched_tokens=chunk, **options).generate([PROMPT], PARAMS)[0])


def two_threads(options: dict) -> object:
    with overridden(cpu_threads=2):
        return again({**options, "enable_prefix_caching": False})


CONDITIONS = {
    "sent twice, prefix cache on": again,
    "sent twice, prefix cache off": lambda o: again({**o, "enable_prefix_caching": False}),
    "sent twice, 2 threads, cache off": two_threads,
    "in a batch of 9": in_batch,
    "prefill in chunks of 16": chunked,
}


def main() -> None:
    for mode, options in (("default", {}), ("batch-invariant", {"batch_invariant": True})):
        alone = sample(LLM(enable_prefix_caching=False, **options).generate([PROMPT], PARAMS)[0])
        for name, run in CONDITIONS.items():
            tokens, logprobs, rows = run(options)
            diffs = [abs(a - b) for a, b in zip(logprobs, alone[1])]
            first = next((i for i, d in enumerate(diffs) if d), None)
            print(f"{mode:16} {name:34} max |dlogprob| {max(diffs):.1e}  first differing step "
                  f"{'-' if first is None else first}  tokens equal {tokens == alone[0]}  rows equal "
                  f"{np.array_equal(rows, alone[2])}")


if __name__ == "__main__":
    main()
