"""Expert parallelism's two combines on the built-in model at EP=2 on the CPU, same run:
"all_reduce" (every rank holds every token, runs its experts' pairs, one all-reduce per MoE
layer) against "all_to_all" (each rank dispatches its 1/N of the tokens' rows to the experts'
owners and back, then an all-gather), with one device as the reference.

    PYTHONPATH=python .venv/bin/python benches/bench_ep.py [--rounds 5]

Prefill of one 512-token prompt and decode steps of 1 and 16 sequences; rounds alternate
between the engines and the ratios are of medians (docs/parallelism.md has the choice).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_tp import step_times
from r3srv import LLM, settings
from r3srv.models.parallel import EP_DISPATCHES

ENGINE = dict(dtype="float32", max_num_seqs=16, num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=1024)


def ep2(dispatch: str) -> LLM:
    """An EP=2 engine whose ranks combine by `dispatch` (rank 0's setting, carried to the worker)."""
    previous = settings.configure(settings.current().replace(ep_dispatch=dispatch))
    try:
        return LLM(tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    finally:
        settings.configure(previous)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    single = LLM(**ENGINE)
    names = ("one device", *EP_DISPATCHES)
    cases = (f"prefill {args.prompt_len}", "decode x1", "decode x16")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name in names:
            # one tensor-parallel engine per process (its process group): each EP engine lives for its round
            llm = single if name == "one device" else ep2(name)
            prefill, decode1 = step_times(llm, args.prompt_len, 1, args.decode_steps)
            _, decode16 = step_times(llm, 16, 16, args.decode_steps)
            for case, t in zip(cases, (prefill, decode1, decode16)):
                times.setdefault((name, case), []).append(t)
            if llm is not single:
                llm.shutdown()
    med = {key: statistics.median(ts) for key, ts in times.items()}
    for case in cases:
        row = ", ".join(f"{name} {med[name, case] * 1e3:.2f} ms" for name in names)
        print(f"{case}: {row}; all_to_all / all_reduce {med['all_to_all', case] / med['all_reduce', case]:.2f}x, "
              f"all_reduce / one device {med['all_reduce', case] / med['one device', case]:.2f}x")
    print(f"(median of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
