"""Decode speed of the built-in model under this source tree and another one (a base commit),
as same-run ratios: did a change make decoding slower?

    git archive BASE python | tar -x -C /tmp/base && cp python/r3srv/_core*.so /tmp/base/python/r3srv/
    .venv/bin/python benches/compare_trees.py /tmp/base [--rounds 7]

One worker process per tree (PYTHONPATH=<tree>/python, one torch thread), each with its own
built-in engine (routed experts on, prefix caching off), in two pairs started in opposite
orders. Rounds alternate which worker goes first; per round each times a 1-sequence decode (128 steps) and an 8-sequence decode (64 steps)
with bench_engine.timed_decode. Printed: median tokens per thread-CPU second (and wall) per tree
and the ratio this/base; thread CPU time is the work done, which a busy machine barely disturbs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {"decode x1": (1, 128), "decode x8": (8, 64)}  # sequences, steps


def worker() -> None:
    """Serve rounds from stdin: each line a round number, each answer a JSON line of rates."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import prompts, timed_decode

    from r3srv import LLM

    torch.set_num_threads(1)
    llm = LLM(enable_return_routed_experts=True, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=16,
              max_num_batched_tokens=4096)
    for name, (seqs, steps) in CASES.items():  # warm-up
        timed_decode(llm, prompts(seqs, 16, 9999), steps)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        r = int(line)
        rates = {}
        for name, (seqs, steps) in CASES.items():
            clock, tokens = timed_decode(llm, prompts(seqs, 16, r), steps)
            rates[name] = (tokens / clock.wall, tokens / clock.cpu)
        print(json.dumps(rates), flush=True)


def start(tree: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree / "python"), R3SRV_CPU_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["ready"]
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the other tree (with python/r3srv and its _core extension)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    trees = {"this": HERE.parent, "base": args.base.resolve()}
    rates: dict[str, list[dict]] = {name: [] for name in trees}
    # two pairs of workers, started in opposite orders: the same tree in both workers of a pair
    # measured up to 10% apart depending on which started first (an A/A run)
    for pair, order in enumerate((("this", "base"), ("base", "this"))):
        workers = {name: start(trees[name]) for name in order}
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                workers[name].stdin.write(f"{pair * args.rounds + r}\n")
                workers[name].stdin.flush()
                rates[name].append(json.loads(workers[name].stdout.readline()))
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
    for case in CASES:
        wall = {n: statistics.median(round_[case][0] for round_ in v) for n, v in rates.items()}
        cpu = {n: statistics.median(round_[case][1] for round_ in v) for n, v in rates.items()}
        print(f"{case}: this {cpu['this']:.1f} tok/CPU-s ({wall['this']:.1f} wall), base {cpu['base']:.1f} "
              f"({wall['base']:.1f} wall); this/base {cpu['this'] / cpu['base']:.3f} CPU, "
              f"{wall['this'] / wall['base']:.3f} wall ({2 * args.rounds} rounds)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
