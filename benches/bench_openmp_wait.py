"""torch's OpenMP threads waiting passively (`r3srv serve`'s choice where the kernels run on a
pool of their own, r3srv/preload.py) against libgomp's default wait (spin 300,000 times, then
sleep; `serve`'s default), as same-run ratios.

    .venv/bin/python benches/bench_openmp_wait.py --threads 1 2 --pairs 6
    .venv/bin/python -m pytest benches/bench_openmp_wait.py -s      (one short pair: a smoke run)

libgomp reads its wait policy once, when torch loads it, so each side runs in a process of its
own: the engine (`LLM`, the built-in model) on bench_vs_vllm.py's workloads and the throughput
workload's prefill half (64 prompts of 256 tokens with one output token each), each workload's
in-flight requests as the engine's max_num_seqs, R3SRV_CPU_THREADS threads, tcmalloc preloaded
where installed (as the server runs). The two sides' processes alternate pair by pair, and
which goes first. Printed: the processor and its instruction sets, each side's median seconds a
round and the median of the per-pair ratios default / passive (> 1: the passive wait is
faster), with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_vs_vllm import MAX_MODEL_LEN, SPLIT_WORKLOADS, WORKLOADS, processor_line  # noqa: E402

BENCH_WORKLOADS = {**WORKLOADS, "throughput-prefill": SPLIT_WORKLOADS["throughput-prefill"]}
WAITS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def worker(workload: str, dtype: str, rounds: int, seed: int) -> list[float]:
    """Wall seconds of `rounds` rounds of the workload after one warm-up round, in this process."""
    import time

    from r3srv.engine.llm import LLM
    from r3srv.sampling_params import SamplingParams

    prompt_len, gen, count, in_flight = BENCH_WORKLOADS[workload]
    llm = LLM(dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=in_flight)
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0)
    took = []
    for i in range(rounds + 1):
        prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(count)]  # fresh: no cache hits
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        if i:
            took.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == gen for o in outputs)
    return took


def run_side(side: dict[str, str], workload: str, dtype: str, threads: int, rounds: int, seed: int) -> list[float]:
    """One worker process with the environment `side` adds (libgomp's wait is the default one
    unless it sets it): its rounds' seconds."""
    from r3srv.preload import preload_env, tcmalloc_path

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(side, R3SRV_CPU_THREADS=str(threads))
    env = preload_env(env, "cpu", True, tcmalloc_path()) or env  # as `r3srv serve` starts
    args = [sys.executable, __file__, "--worker", workload, "--dtype", dtype, "--rounds", str(rounds),
            "--seed", str(seed)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(workload: str, dtype: str, threads: int, pairs: int, rounds: int,
            sides: dict[str, dict[str, str]] = WAITS) -> dict[str, list[float]]:
    """Each pair's median seconds per side (by name: the environment it adds), the sides
    alternating which goes first."""
    took: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(pairs):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            took[name].append(statistics.median(run_side(sides[name], workload, dtype, threads, rounds, seed=i)))
    return took


def report(workload: str, dtype: str, threads: int, took: dict[str, list[float]], before: str = "default",
           after: str = "passive") -> str:
    """The sides' median seconds and the median (range) of the per-pair ratios before / after."""
    ratios = [b / a for b, a in zip(took[before], took[after], strict=True)]
    return (f"{dtype} threads={threads} {workload:18s} {before} {statistics.median(took[before]):.3f} s, {after} "
            f"{statistics.median(took[after]):.3f} s; {before}/{after} {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} pairs")


def test_openmp_wait_smoke():
    """One pair of one round on the prefill half at two threads: both sides run and time it (no
    speed gate)."""
    took = compare("throughput-prefill", "float32", 2, pairs=1, rounds=1)
    print(processor_line())
    print(report("throughput-prefill", "float32", 2, took))
    assert all(len(v) == 1 and v[0] > 0 for v in took.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pairs", type=int, default=6, help="processes per side, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds in each process")
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--workloads", nargs="+", choices=tuple(BENCH_WORKLOADS), default=list(BENCH_WORKLOADS))
    parser.add_argument("--worker", choices=tuple(BENCH_WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dtype[0], args.rounds, args.seed)))
        return
    print(processor_line(), flush=True)
    for dtype in args.dtype:
        for threads in args.threads:
            for workload in args.workloads:
                print(report(workload, dtype, threads, compare(workload, dtype, threads, args.pairs, args.rounds)),
                      flush=True)


if __name__ == "__main__":
    main()
