"""Decode and prefill step time of the built-in model at TP=2 against TP=1 on the CPU, same run.

    PYTHONPATH=python .venv/bin/python benches/bench_tp.py [--rounds 5] [--device cuda]

Both engines live in this process (TP=2's second rank is a worker process); rounds
alternate between them, and the ratios are of medians. On a CPU the ranks share the memory
bandwidth and every row-parallel layer adds a gloo all-reduce, so TP=2 is not expected to
be faster here: the number says what the split costs, the gain is the device count on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from r3srv import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_num_seqs=8, num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=1024)


def step_times(llm: LLM, prompt_len: int, seqs: int, decode_steps: int) -> tuple[float, float]:
    """(prefill step seconds for one prompt_len prompt, mean decode step seconds for `seqs` sequences)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=decode_steps + 1)
    engine.reset_prefix_cache()
    engine.add_request("prefill", [(7 * i) % 250 for i in range(prompt_len)], SamplingParams(temperature=0, max_tokens=1))
    t = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    for s in range(seqs):
        engine.add_request(f"d{s}", [(11 * i + s) % 250 for i in range(16)], params)
    engine.step()  # the prompts
    t = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    decode = (time.perf_counter() - t) / decode_steps
    while engine.has_unfinished():
        engine.step()
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu (gloo ranks) or cuda (one GPU per rank, NCCL; gpu_check.sh)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = dict(ENGINE, device=args.device)
    engines = {"tp1": LLM(**engine), "tp2": LLM(tensor_parallel_size=2, **engine)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times[name].append(step_times(llm, args.prompt_len, args.seqs, args.decode_steps))
    med = {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for name, ts in times.items()}
    for name, (prefill, decode) in med.items():
        print(f"{name}: prefill {args.prompt_len} tokens {prefill * 1e3:.1f} ms, decode step x{args.seqs} {decode * 1e3:.2f} ms")
    print(f"tp2 / tp1: prefill {med['tp2'][0] / med['tp1'][0]:.2f}x, decode {med['tp2'][1] / med['tp1'][1]:.2f}x "
          f"(median of {args.rounds} alternating rounds)")
    engines["tp2"].shutdown()


if __name__ == "__main__":
    main()
