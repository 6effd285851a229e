"""The Rust CPU kernels on torch's OpenMP team (the default, kernels/kernel_threads.py) against
their own rayon pool (`R3SRV_OPENMP_KERNEL_THREADS=0`), as same-run ratios.

    .venv/bin/python benches/bench_kernel_threads.py --threads 2 --pairs 4
    .venv/bin/python -m pytest benches/bench_kernel_threads.py -s      (one short pair: a smoke run)

Each side is an engine process (`LLM`, the built-in model) as bench_openmp_wait.py runs them
(its workloads, tcmalloc preloaded where installed), the sides' processes alternating pair by
pair, under each of libgomp's waits: its default (spin, then sleep), what a caller's own process
has, and the passive wait `r3srv serve` sets. At one thread nothing differs (a kernel on one
thread runs on the caller's). Printed: the processor and its instruction sets, each side's median
seconds a round and the median (range) of the per-pair ratios rayon / openmp (> 1: torch's team
is faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_openmp_wait import BENCH_WORKLOADS, WAITS, compare, report  # noqa: E402
from bench_vs_vllm import processor_line  # noqa: E402

TEAMS = {"rayon": {"R3SRV_OPENMP_KERNEL_THREADS": "0"}, "openmp": {"R3SRV_OPENMP_KERNEL_THREADS": "1"}}


def sides(wait: str) -> dict[str, dict[str, str]]:
    """Both teams under libgomp's `wait`."""
    return {team: {**env, **WAITS[wait]} for team, env in TEAMS.items()}


def test_kernel_threads_smoke():
    """One pair of one round on the long prompt at two threads, default wait: both sides run and
    time it (no speed gate)."""
    took = compare("long", "float32", 2, pairs=1, rounds=1, sides=sides("default"))
    print(processor_line())
    print(report("long", "float32", 2, took, "rayon", "openmp"))
    assert all(len(v) == 1 and v[0] > 0 for v in took.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--pairs", type=int, default=4, help="processes per side, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds in each process")
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--waits", nargs="+", choices=tuple(WAITS), default=list(WAITS))
    parser.add_argument("--workloads", nargs="+", choices=tuple(BENCH_WORKLOADS), default=list(BENCH_WORKLOADS))
    args = parser.parse_args()
    print(processor_line(), flush=True)
    for dtype in args.dtype:
        for threads in args.threads:
            for wait in args.waits:
                for workload in args.workloads:
                    took = compare(workload, dtype, threads, args.pairs, args.rounds, sides=sides(wait))
                    print(f"{wait} wait: {report(workload, dtype, threads, took, 'rayon', 'openmp')}", flush=True)


if __name__ == "__main__":
    main()
